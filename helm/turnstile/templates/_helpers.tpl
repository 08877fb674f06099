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
The schema of Turnstile's tables, for the server and the migration Job alike.
*/}}
{{- define "turnstile.databaseSchemaEnv" -}}
- name: TURNSTILE_DATABASE_SCHEMA
  value: {{ required "database.schema is required" .Values.database.schema | quote }}
{{- end }}

{{/*
PGSSLMODE and PGSSLROOTCERT for the server and the migration Job: libpq's variables, used when the
URL names no sslmode or sslrootcert.
*/}}
{{- define "turnstile.databaseTlsEnv" -}}
{{- with .Values.database.tls.sslMode }}
- name: PGSSLMODE
  value: {{ . | quote }}
{{- end }}
{{- if .Values.database.tls.caSecret }}
- name: PGSSLROOTCERT
  value: /etc/turnstile/postgres-ca/{{ .Values.database.tls.caKey }}
{{- end }}
{{- end }}

{{/*
The volume holding the PostgreSQL CA, when one is configured.
*/}}
{{- define "turnstile.databaseCaVolume" -}}
{{- if .Values.database.tls.caSecret }}
- name: postgres-ca
  secret:
    secretName: {{ .Values.database.tls.caSecret }}
    items:
      - key: {{ .Values.database.tls.caKey }}
        path: {{ .Values.database.tls.caKey }}
{{- end }}
{{- end }}

{{- define "turnstile.databaseCaVolumeMount" -}}
{{- if .Values.database.tls.caSecret }}
- name: postgres-ca
  mountPath: /etc/turnstile/postgres-ca
  readOnly: true
{{- end }}
{{- end }}

{{/*
The server container's volume mounts: auth tokens, TLS, the PostgreSQL CA, then extraVolumeMounts.
Empty when there are none.
*/}}
{{- define "turnstile.serverVolumeMounts" -}}
{{- if .Values.auth.existingSecret }}
- name: auth-tokens
  mountPath: /etc/turnstile/auth
  readOnly: true
{{- end }}
{{- if .Values.tls.existingSecret }}
- name: tls
  mountPath: /etc/turnstile/tls
  readOnly: true
{{- if and .Values.tls.clientAuth .Values.probes.tls.clientSecret }}
- name: probe-client
  mountPath: /etc/turnstile/probe-client
  readOnly: true
{{- end }}
{{- end }}
{{- include "turnstile.databaseCaVolumeMount" . }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The server pods' volumes, matching turnstile.serverVolumeMounts, then extraVolumes.
*/}}
{{- define "turnstile.serverVolumes" -}}
{{- if .Values.auth.existingSecret }}
- name: auth-tokens
  secret:
    secretName: {{ .Values.auth.existingSecret }}
    items:
      - key: {{ .Values.auth.secretKey }}
        path: {{ .Values.auth.secretKey }}
{{- end }}
{{- if .Values.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ .Values.tls.existingSecret }}
{{- if and .Values.tls.clientAuth .Values.probes.tls.clientSecret }}
- name: probe-client
  secret:
    secretName: {{ .Values.probes.tls.clientSecret }}
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
{{- end }}
{{- end }}
{{- include "turnstile.databaseCaVolume" . }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
DATABASE_URL for the migration Job: database.migration's Secret (straight to PostgreSQL, past a
pooler) when set, the server's otherwise.
*/}}
{{- define "turnstile.migrationDatabaseUrlEnv" -}}
{{- if .Values.database.migration.existingSecret }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.database.migration.existingSecret }}
      key: {{ required "database.migration.secretKey is required" .Values.database.migration.secretKey }}
{{- else }}
{{- include "turnstile.databaseUrlEnv" . }}
{{- end }}
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

{{/*
Selector labels of the gateway pods (its Deployment and Service).
*/}}
{{- define "turnstile.gatewaySelectorLabels" -}}
{{ include "turnstile.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{/*
The server pods' exec probe with TLS, as a JSON list: the image's `turnstile health-check` asks
the server over TLS on loopback for `service`'s status, checking the certificate against the tls
Secret's ca.crt under the name it carries, and presenting a client certificate under mutual TLS.
Called with a dict: root (the top context), service, probe (the probe's timing values).
*/}}
{{- define "turnstile.healthCheckCommand" -}}
{{- $root := .root }}
{{- $values := $root.Values }}
{{- $name := $values.probes.tls.serverName | default $values.tests.serverName | default (printf "%s.%s.svc" (include "turnstile.fullname" $root) $root.Release.Namespace) }}
{{- $command := list "/usr/local/bin/turnstile" "health-check" "--address" (printf "https://127.0.0.1:%v" $values.containerPort) "--ca-cert" "/etc/turnstile/tls/ca.crt" "--tls-domain" $name "--timeout-secs" (toString (.probe.timeoutSeconds | default 1)) }}
{{- with .service }}
{{- $command = concat $command (list "--service" .) }}
{{- end }}
{{- if $values.tls.clientAuth }}
{{- $dir := ternary "/etc/turnstile/probe-client" "/etc/turnstile/tls" (not (empty $values.probes.tls.clientSecret)) }}
{{- $command = concat $command (list "--cert" (printf "%s/tls.crt" $dir) "--key" (printf "%s/tls.key" $dir)) }}
{{- end }}
{{- toJson $command }}
{{- end }}

{{/*
A map of bots (bot: value, as config.doubleText and config.botScopes) as TURNSTILE_DOUBLE_TEXT
and TURNSTILE_BOT_SCOPES take it: bot=value,bot=value, in the bots' order.
*/}}
{{- define "turnstile.perBot" -}}
{{- $pairs := list -}}
{{- range $bot, $policy := . -}}
{{- $pairs = append $pairs (printf "%s=%s" $bot $policy) -}}
{{- end -}}
{{- join "," $pairs -}}
{{- end -}}
