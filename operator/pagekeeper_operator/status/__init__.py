"""LLMServer status from observation (pure): the conditions, replica counts and the effective
policy (`conditions`), the kstatus conditions GitOps tools read (`progress`), a refused write in
one sentence (`refusal`), the API key's Secret (`api_key`) and the merge patch of the fields
the operator owns (`patch`)."""
