{{/* Names and labels. */}}
{{- define "flotilla.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "flotilla.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* KubeRay keeps the serve Service's name; other objects point at it. */}}
{{- define "flotilla.serveServiceName" -}}
{{- printf "%s-serve-svc" (include "flotilla.fullname" .) -}}
{{- end -}}

{{- define "flotilla.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flotilla.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "flotilla.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "flotilla.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "flotilla.image" -}}
{{- if not .Values.image.repository -}}
{{- fail "image.repository is required: an image with Ray and Flotilla installed" -}}
{{- end -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
serveConfigV2: the config `serve build deployments.app:build_app` writes, with the
app's args taken from .Values.app (AppArgs fields). Keys come from Secrets as env vars.
*/}}
{{- define "flotilla.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ .Values.serve.port }}
applications:
  - name: flotilla
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      {{- toYaml .Values.app | nindent 6 }}
{{- end -}}

{{/* FLOTILLA_API_KEY / FLOTILLA_ADMIN_KEY from Secrets, plus .Values.env. */}}
{{- define "flotilla.env" -}}
{{- if eq .Values.serve.httpProxy "haproxy" }}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: "1"
{{- end }}
{{- with .Values.apiKey.secretName }}
- name: FLOTILLA_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.apiKey.secretKey }}
{{- end }}
{{- with .Values.adminKey.secretName }}
- name: FLOTILLA_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.adminKey.secretKey }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Render-time checks that values.schema.json cannot express (they compare fields).
Defaults are AppArgs' own. */}}
{{- define "flotilla.checks" -}}
{{- $app := .Values.app -}}
{{- range .Values.env -}}
{{- if and (has .name (list "FLOTILLA_API_KEY" "FLOTILLA_ADMIN_KEY" "RAY_AUTH_TOKEN")) (hasKey . "value") -}}
{{- fail (printf "env %s has a plain value: it would sit in the RayService object; use apiKey/adminKey.secretName (or valueFrom.secretKeyRef)" .name) -}}
{{- end -}}
{{- end -}}
{{- if ge (int .Values.termination.preStopSleepSeconds) (int .Values.termination.gracePeriodSeconds) -}}
{{- fail "termination.preStopSleepSeconds must be shorter than gracePeriodSeconds (SIGTERM comes after the sleep, within the grace period)" -}}
{{- end -}}
{{- $as := dig "ingress_autoscaling" dict $app -}}
{{- if gt (float64 (dig "min_replicas" 1 $as)) (float64 (dig "max_replicas" 4 $as)) -}}
{{- fail "app.ingress_autoscaling.min_replicas is larger than max_replicas" -}}
{{- end -}}
{{- $tp := float64 (dig "tensor_parallel_size" 1 $app) -}}
{{- $needGpus := mulf (dig "engine_num_gpus" 0 $app) $tp -}}
{{- $needCpus := mulf (dig "engine_num_cpus" 1 $app) $tp -}}
{{- $dp := float64 (dig "data_parallel_size" 1 $app) -}}
{{- $fit := 0.0 -}}
{{- range .Values.workerGroups -}}
{{- if and (le $needGpus (float64 .gpus)) (le $needCpus (float64 .cpu)) -}}
{{- $perPod := 1000000.0 -}}
{{- if gt $needGpus 0.0 -}}{{- $perPod = floor (divf .gpus $needGpus) -}}{{- end -}}
{{- if gt $needCpus 0.0 -}}{{- $perPod = minf $perPod (floor (divf .cpu $needCpus)) -}}{{- end -}}
{{- $fit = addf $fit (mulf $perPod .maxReplicas) -}}
{{- end -}}
{{- end -}}
{{- if lt $fit $dp -}}
{{- fail (printf "the worker groups hold %v engine replicas at their maxReplicas but app.data_parallel_size is %v (one engine needs %v GPUs and %v CPUs in one pod)" $fit $dp $needGpus $needCpus) -}}
{{- end -}}
{{- end -}}
