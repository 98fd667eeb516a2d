{{/* Names, labels and the checks the JSON schema cannot express. */}}

{{- define "elastic-gpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name; if the release name already contains the chart name, use it. */}}
{{- define "elastic-gpu.fullname" -}}
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

{{/* Names of cluster-scoped objects (and of objects in a namespace every release shares): the
release's full name and its namespace, so the same release name in two namespaces collides on
nothing but the PriorityClasses, which the hub's config names (tests/helm/test_two_releases_gitops.py). */}}
{{- define "elastic-gpu.clusterName" -}}
{{- printf "%s-%s" (include "elastic-gpu.fullname" .) .Release.Namespace | trunc 200 | trimSuffix "-" }}
{{- end }}

{{- define "elastic-gpu.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "elastic-gpu.labels" -}}
helm.sh/chart: {{ include "elastic-gpu.chart" . }}
app.kubernetes.io/name: {{ include "elastic-gpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: elastic-gpu
{{- end }}

{{/* Selector labels of one component: include with (dict "root" $ "component" "node-agent"). */}}
{{- define "elastic-gpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elastic-gpu.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "elastic-gpu.componentLabels" -}}
{{ include "elastic-gpu.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "elastic-gpu.userNamespace" -}}
{{- .Values.userNamespace | default .Release.Namespace }}
{{- end }}

{{- define "elastic-gpu.hubNamespace" -}}
{{- .Values.hub.serviceAccount.namespace | default .Release.Namespace }}
{{- end }}

{{- define "elastic-gpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- /* the culler's image: the hub image (z2jh 4.3.3's k8s-hub + our wheel, helm/README.md) */}}
{{- define "elastic-gpu.culler.image" -}}
{{- printf "%s:%s" .Values.culler.image.repository (.Values.culler.image.tag | default (printf "4.3.3-%s" .Chart.AppVersion)) }}
{{- end }}

{{- define "elastic-gpu.userServiceAccountName" -}}
{{- .Values.userServiceAccount.name | default (printf "%s-user" (include "elastic-gpu.fullname" .)) }}
{{- end }}

{{/* The node agent's namespace: its own (Pod Security 'privileged'), not the users'; a Namespace
is cluster-scoped, so its default name carries the release's namespace (at most 63 characters). */}}
{{- define "elastic-gpu.nodeAgent.namespace" -}}
{{- .Values.nodeAgent.namespace.name | default (printf "%s-node-agent" (include "elastic-gpu.clusterName" . | trunc 52 | trimSuffix "-")) }}
{{- end }}

{{/* PriorityClasses are cluster-wide: named after the release unless a prefix is given (the hub's
c.ElasticGPUSpawner.gpu_priority_class_prefix must match; a second release of the same name
shares the first one's: priorityClasses.create: false). */}}
{{- define "elastic-gpu.priorityClassPrefix" -}}
{{- .Values.priorityClasses.prefix | default (printf "%s-" (include "elastic-gpu.fullname" .)) }}
{{- end }}

{{/* The claim of the node agent's host directory in the users' namespace (c.ElasticGPUSpawner.gpu_host_claim). */}}
{{- define "elastic-gpu.hostClaimName" -}}
{{- printf "%s-host" (include "elastic-gpu.fullname" .) }}
{{- end }}

{{/* Its PersistentVolume (cluster-wide: named after the release and the users' namespace). */}}
{{- define "elastic-gpu.hostVolumeName" -}}
{{- printf "%s-host-%s" (include "elastic-gpu.fullname" .) (include "elastic-gpu.userNamespace" .) | trunc 253 }}
{{- end }}

{{- define "elastic-gpu.nodeAgent.serviceAccountName" -}}
{{- .Values.nodeAgent.serviceAccount.name | default (printf "%s-node-agent" (include "elastic-gpu.fullname" .)) }}
{{- end }}

{{- define "elastic-gpu.admissionConfigMapName" -}}
{{- printf "%s-admission" (include "elastic-gpu.fullname" .) }}
{{- end }}

{{- define "elastic-gpu.culler.secretName" -}}
{{- if .Values.culler.apiToken.value }}
{{- printf "%s-culler" (include "elastic-gpu.fullname" .) }}
{{- else }}
{{- .Values.culler.apiToken.existingSecret.name }}
{{- end }}
{{- end }}

{{- define "elastic-gpu.culler.secretKey" -}}
{{- if .Values.culler.apiToken.value }}api-token{{ else }}{{ .Values.culler.apiToken.existingSecret.key }}{{ end }}
{{- end }}

{{/*
Cross-field checks the JSON schema cannot express; each failure names the key and what is
allowed. Included once, from the admission ConfigMap template.
*/}}
{{- define "elastic-gpu.validate" -}}
{{- $classes := keys .Values.admission.priority_classes | sortAlpha }}
{{- if not $classes }}
{{- fail "admission.priority_classes: define at least one priority class, e.g. {default: {value: 100}}" }}
{{- end }}
{{- range $classes }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .) }}
{{- fail (printf "admission.priority_classes: class name %q must be lower-case letters, digits and '-' (it also names a Kubernetes PriorityClass)" .) }}
{{- end }}
{{- end }}
{{- if not (has .Values.admission.default_priority_class $classes) }}
{{- fail (printf "admission.default_priority_class: %q is not one of admission.priority_classes (%s)" .Values.admission.default_priority_class (join ", " $classes)) }}
{{- end }}
{{- if .Values.priorityClasses.create }}
{{- range $classes }}
{{- $full := printf "%s%s" (include "elastic-gpu.priorityClassPrefix" $) . }}
{{- if gt (len $full) 253 }}
{{- fail (printf "priorityClasses.prefix: %q + class %q is longer than 253 characters" $.Values.priorityClasses.prefix .) }}
{{- end }}
{{- if hasPrefix "system-" $full }}
{{- fail (printf "priorityClasses.prefix: PriorityClass names may not start with 'system-' (got %q)" $full) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.culler.enabled (not .Values.culler.apiToken.value) (not .Values.culler.apiToken.existingSecret.name) }}
{{- fail "culler.apiToken: set culler.apiToken.value or culler.apiToken.existingSecret.name (or culler.enabled: false)" }}
{{- end }}
{{- end }}

{{/* z2jh's singleuser egress sandbox (networkPolicy.egressAllowRules, z2jh's keys and defaults):
the rules of an egress list, for the kernels' and the users' servers' NetworkPolicies. */}}
{{- define "elastic-gpu.egressRules" -}}
{{- $rules := .Values.networkPolicy.egressAllowRules }}
{{- $metadata := printf "%s/32" .Values.networkPolicy.cloudMetadataIp }}
{{- $private := list "10.0.0.0/8" "172.16.0.0/12" "192.168.0.0/16" }}
{{- if or $rules.dnsPortsCloudMetadataServer $rules.dnsPortsKubeSystemNamespace $rules.dnsPortsPrivateIPs }}
- ports:
    - {port: 53, protocol: UDP}
    - {port: 53, protocol: TCP}
  to:
    {{- if $rules.dnsPortsCloudMetadataServer }}
    - ipBlock: {cidr: {{ $metadata }}}
    {{- end }}
    {{- if $rules.dnsPortsKubeSystemNamespace }}
    - namespaceSelector:
        matchLabels:
          kubernetes.io/metadata.name: kube-system
    {{- end }}
    {{- if $rules.dnsPortsPrivateIPs }}
    {{- range $private }}
    - ipBlock: {cidr: {{ . }}}
    {{- end }}
    {{- end }}
{{- end }}
{{- if $rules.nonPrivateIPs }}
- to:
    - ipBlock:
        cidr: 0.0.0.0/0
        except:
          {{- range $private }}
          - {{ . }}
          {{- end }}
          - {{ $metadata }}
{{- end }}
{{- if $rules.privateIPs }}
- to:
    {{- range $private }}
    - ipBlock: {cidr: {{ . }}}
    {{- end }}
{{- end }}
{{- if $rules.cloudMetadataServer }}
- to:
    - ipBlock: {cidr: {{ $metadata }}}
{{- end }}
{{- end }}
