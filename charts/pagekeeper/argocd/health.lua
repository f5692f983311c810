-- Argo CD health of a pagekeeper.dev LLMServer, from the conditions its operator writes
-- (docs/gitops.md has the table). Order matters: a deletion or a generation the operator has
-- not reconciled yet says nothing about the new spec; Stalled (no progress without a change)
-- beats Reconciling; replicas 0 without an autoscaler is a deliberate pause.
local hs = {}

local function condition(conditions, type_)
  for _, c in ipairs(conditions or {}) do
    if c.type == type_ then
      return c
    end
  end
  return nil
end

local function detail(c)
  if c.message ~= nil and c.message ~= "" then
    return c.reason .. ": " .. c.message
  end
  return c.reason
end

if obj.metadata.deletionTimestamp ~= nil then
  hs.status = "Progressing"
  hs.message = "The LLMServer is being deleted"
  return hs
end

local status = obj.status
local generation = obj.metadata.generation
if status == nil or status.observedGeneration == nil or status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to reconcile the LLMServer"
  return hs
end
if generation ~= nil and status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end

local stalled = condition(status.conditions, "Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = detail(stalled)
  return hs
end

-- An operator older than the Reconciling condition wrote only Progressing.
local reconciling = condition(status.conditions, "Reconciling")
if reconciling == nil then
  reconciling = condition(status.conditions, "Progressing")
end
if reconciling ~= nil and reconciling.status == "True" then
  hs.status = "Progressing"
  hs.message = detail(reconciling)
  return hs
end

if obj.spec ~= nil and obj.spec.replicas == 0 and obj.spec.autoscaling == nil then
  hs.status = "Suspended"
  hs.message = "Scaled to zero: spec.replicas is 0"
  return hs
end

local ready = condition(status.conditions, "Ready")
if ready == nil or ready.status == "Unknown" then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ready condition"
elseif ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message
else
  hs.status = "Degraded"
  hs.message = detail(ready)
end
return hs
