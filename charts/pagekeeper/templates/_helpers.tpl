{{/*
Names and labels shared by every template.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "pagekeeper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Base name of the release's objects: fullnameOverride, else "<release>-<chart>" (just the release
name when it already contains the chart name). 63 characters at most: Service and label limits.
*/}}
{{- define "pagekeeper.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "pagekeeper.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels that select the operator's pods; never change them (Deployment selectors are immutable). */}}
{{- define "pagekeeper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagekeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "pagekeeper.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pagekeeper.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pagekeeper
{{- end }}

{{/* Name of the operator's Deployment, Service, ServiceAccount and RBAC objects. */}}
{{- define "pagekeeper.operatorName" -}}
{{- printf "%s-operator" (include "pagekeeper.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "pagekeeper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagekeeper.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: repository@digest, else repository:tag (tag defaults to appVersion). */}}
{{- define "pagekeeper.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Whether replicas share a kopf peering (one acts, the others stand by). */}}
{{- define "pagekeeper.isPeering" -}}
{{- if gt (int .Values.replicas) 1 }}true{{ end }}
{{- end }}

{{/* Name of the kopf peering object (ClusterKopfPeering, or KopfPeering per watched namespace). */}}
{{- define "pagekeeper.peeringName" -}}
{{- default (include "pagekeeper.fullname" .) .Values.operator.peeringName }}
{{- end }}

{{/* The Secret holding the Alertmanager webhook's bearer token, and its key. */}}
{{- define "pagekeeper.webhookSecretName" -}}
{{- default (printf "%s-webhook" (include "pagekeeper.fullname" .)) .Values.webhook.token.existingSecret }}
{{- end }}

{{/* The URL Alertmanager posts to: the Service's cluster DNS name. */}}
{{- define "pagekeeper.webhookUrl" -}}
{{- printf "%s://%s.%s.svc:%d/alertmanager" (ternary "https" "http" (not (empty .Values.webhook.tls.secretName))) (include "pagekeeper.operatorName" .) .Release.Namespace (int .Values.webhook.service.port) }}
{{- end }}

{{/*
RBAC rules for the objects the operator reconciles in a namespace, shared by the ClusterRole
(cluster-wide) and the Roles (watchNamespaces). docs/operator.md explains each verb.
*/}}
{{- define "pagekeeper.namespacedRules" -}}
- apiGroups: ["pagekeeper.dev"]
  resources: ["llmservers"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["pagekeeper.dev"]
  resources: ["llmservers/status"]
  verbs: ["patch"]
- apiGroups: ["pagekeeper.dev"]
  resources: ["llmservers/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors", "prometheusrules"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: [""]
  resources: ["pods/eviction"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.rbac.readApiKeySecrets }}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
{{- end }}
{{- end }}
