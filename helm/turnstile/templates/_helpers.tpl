{{/*
Chart name, truncated to the 63 characters a DNS label allows.
*/}}
{{- define "turnstile.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name; the release name alone when it already contains the chart name.
*/}}
{{- define "turnstile.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "turnstile.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every object.
*/}}
{{- define "turnstile.labels" -}}
helm.sh/chart: {{ include "turnstile.chart" . }}
{{ include "turnstile.selectorLabels" . }}
app.kubernetes.io/version: {{ include "turnstile.imageTag" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels that pick the release's pods; add a component label to tell the server from the migration.
*/}}
{{- define "turnstile.selectorLabels" -}}
app.kubernetes.io/name: {{ include "turnstile.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Selector labels of the server pods (Deployment, Services, HPA, PDB, NetworkPolicy).
*/}}
{{- define "turnstile.serverSelectorLabels" -}}
{{ include "turnstile.selectorLabels" . }}
app.kubernetes.io/component: server
{{- end }}

{{- define "turnstile.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "turnstile.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "turnstile.imageTag" -}}
{{- .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "turnstile.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "turnstile.imageTag" .) }}
{{- end }}

{{/*
The existing Secret holding DATABASE_URL; rendering fails with this message when it is unset.
*/}}
{{- define "turnstile.databaseSecret" -}}
{{- required "database.existingSecret is required: the name of an existing Secret whose key database.secretKey holds the PostgreSQL URL (kubectl create secret generic turnstile-database --from-literal=database-url=postgres://...)" .Values.database.existingSecret }}
{{- end }}

{{/*
DATABASE_URL taken from the existing Secret, for the server and the migration Job.
*/}}
{{- define "turnstile.databaseUrlEnv" -}}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "turnstile.databaseSecret" . }}
      key: {{ required "database.secretKey is required" .Values.database.secretKey }}
{{- end }}

{{/*
terminationGracePeriodSeconds: preStop sleep, then the server's drain, then a margin to exit.
Derived from the same values the server gets, so they cannot drift apart.
*/}}
{{- define "turnstile.terminationGracePeriodSeconds" -}}
{{- add .Values.termination.preStopSleepSeconds .Values.config.shutdownGraceSeconds .Values.termination.marginSeconds }}
{{- end }}

{{/*
How many server pods run at least: autoscaling's minimum when it is on, replicaCount otherwise.
*/}}
{{- define "turnstile.minReplicas" -}}
{{- if .Values.autoscaling.enabled }}
{{- .Values.autoscaling.minReplicas }}
{{- else }}
{{- .Values.replicaCount }}
{{- end }}
{{- end }}
