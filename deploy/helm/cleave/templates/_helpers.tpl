{{/* "plan" or "repository": what this release runs. Exactly one of `plan` (a deployment
plan: shards, rankers and routers as pods) and `repository.pvc` (a model repository served by
one pod, templates/repository.yaml) must be set. */}}
{{- define "cleave.mode" -}}
{{- $plan := .Values.plan -}}
{{- $repository := .Values.repository.pvc -}}
{{- if and $plan $repository -}}
{{- fail "plan and repository.pvc are both set: the chart runs a deployment plan or serves a model repository, not both; unset one (--set plan= for the repository, or --set repository.pvc= for the plan)" -}}
{{- else if $repository -}}
repository
{{- else if $plan -}}
plan
{{- else -}}
{{- fail "plan is required, or repository.pvc: set plan to the deployment plan as `cleave plan` wrote it (--set-file plan=dlrm.yaml, docs/plan.md), or repository.pvc to a claim holding a model repository (docs/deploy.md, \"Serving a model repository\")" -}}
{{- end -}}
{{- end -}}

{{/* The plan, parsed and checked, as JSON: `include "cleave.plan" . | fromJson`. Bad input
fails the render with what was expected and what arrived. */}}
{{- define "cleave.plan" -}}
{{- $text := required "plan is required: the deployment plan as `cleave plan` wrote it, e.g. --set-file plan=dlrm.yaml (docs/plan.md)" .Values.plan -}}
{{- if not (kindIs "string" $text) -}}
{{- fail (printf "plan: expected the plan file's text (--set-file plan=dlrm.yaml), got a %s" (kindOf $text)) -}}
{{- end -}}
{{- $plan := fromYaml $text -}}
{{- if hasKey $plan "Error" -}}
{{- fail (printf "plan: not valid YAML: %s" (index $plan "Error")) -}}
{{- end -}}
{{- if ne (toString (index $plan "format")) "cleave-plan" -}}
{{- fail (printf "plan: expected `format: cleave-plan` (a file written by `cleave plan`), got format %v" (index $plan "format" | default "missing")) -}}
{{- end -}}
{{- if ne (toString (index $plan "version")) "1" -}}
{{- fail (printf "plan: this chart reads plan version 1, got version %v" (index $plan "version" | default "missing")) -}}
{{- end -}}
{{- range $key := list "name" "mode" "transport" "hosts" "shards" "rankers" "routers" "supervision" -}}
{{- if not (hasKey $plan $key) -}}
{{- fail (printf "plan: key %q is missing (docs/plan.md lists every key)" $key) -}}
{{- end -}}
{{- end -}}
{{- if ne $plan.mode "disaggregated" -}}
{{- fail (printf "plan: mode %q: the chart runs disaggregated plans only (make the plan without monolithic)" $plan.mode) -}}
{{- end -}}
{{- if ne $plan.transport "tcp" -}}
{{- fail (printf "plan: transport %q: pods talk over TCP; make the plan for 2 or more hosts (cleave plan --hosts N or --cluster FILE)" $plan.transport) -}}
{{- end -}}
{{- if or (empty $plan.shards) (empty $plan.rankers) (empty $plan.routers) -}}
{{- fail (printf "plan: expected at least one shard, ranker and router, got %d, %d and %d" (len ($plan.shards | default list)) (len ($plan.rankers | default list)) (len ($plan.routers | default list))) -}}
{{- end -}}
{{- /* What a plan leaves out takes the settings schema's default (files/settings.json,
generated from python/cleave/settings by `python -m cleave.settings --write`). */ -}}
{{- $defaults := $.Files.Get "files/settings.json" | fromJson -}}
{{- $_ := set $plan "router" ($plan.router | default dict) -}}
{{- range $section, $roles := dict "plan" (list $plan) "router" (list $plan.router) "shard" $plan.shards "ranker" $plan.rankers -}}
{{- range $role := $roles -}}
{{- range $key, $value := index $defaults $section -}}
{{- if not (hasKey $role $key) -}}{{- $_ := set $role $key $value -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $first := index $plan.rankers 0 -}}
{{- range $i, $r := $plan.rankers -}}
{{- range $key := list "device" "threads" "max_batch" "max_wait_ms" "max_queue" "queue" "cuda_graphs" "compile" "compile_cache" -}}
{{- if ne (toString (index $r $key)) (toString (index $first $key)) -}}
{{- fail (printf "plan: rankers[%d].%s is %v but rankers[0].%s is %v: every ranker pod runs one template, so the plan's rankers must share their settings" $i $key (index $r $key) $key (index $first $key)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if gt (len .Release.Name) 40 -}}
{{- fail (printf "release name %q: at most 40 characters (pod and Service names add to it)" .Release.Name) -}}
{{- end -}}
{{- if lt (int .Values.router.autoscaling.maxReplicas) (len $plan.routers) -}}
{{- fail (printf "router.autoscaling.maxReplicas is %v: expected at least the plan's %d routers" .Values.router.autoscaling.maxReplicas (len $plan.routers)) -}}
{{- end -}}
{{- if lt (int .Values.ranker.autoscaling.maxReplicas) (len $plan.rankers) -}}
{{- fail (printf "ranker.autoscaling.maxReplicas is %v: expected at least the plan's %d rankers" .Values.ranker.autoscaling.maxReplicas (len $plan.rankers)) -}}
{{- end -}}
{{- if and (not .Values.bundle.pvc) (not .Values.bundle.fetch.image) -}}
{{- fail "bundle: set bundle.pvc (a claim holding the bundle) or bundle.fetch.image and bundle.fetch.command (an init container that fetches it)" -}}
{{- end -}}
{{- if and (not .Values.bundle.pvc) (empty .Values.bundle.fetch.command) -}}
{{- fail "bundle.fetch.command: expected the command that writes the bundle into $BUNDLE_DIR, got none" -}}
{{- end -}}
{{- $token := dig "admin_token_env" "" ($plan.router | default dict) -}}
{{- if and $token (not .Values.router.adminTokenSecret.name) -}}
{{- fail (printf "the plan's router.admin_token_env is %q: set router.adminTokenSecret.name to a Secret holding the token" $token) -}}
{{- end -}}
{{- $secret := dig "internal_secret_env" "" ($plan.router | default dict) -}}
{{- if and $secret (not .Values.internalSecret.name) -}}
{{- fail (printf "the plan's router.internal_secret_env is %q: set internalSecret.name to a Secret holding the deployment's internal secret" $secret) -}}
{{- end -}}
{{- $queue := (index $plan.shards 0).queue -}}
{{- range $i, $s := $plan.shards -}}
{{- if ne $s.queue $queue -}}
{{- fail (printf "plan: shards[%d].queue is %v but shards[0].queue is %v: every shard pod runs one template, so the plan's shards must share their queue policy" $i $s.queue $queue) -}}
{{- end -}}
{{- end -}}
{{- toJson $plan -}}
{{- end -}}

{{/* CLEAVE_INTERNAL_SECRET from internalSecret, when the plan names an internal secret: the
variable every role reads (docs/security.md). (dict "ctx" $ "plan" $plan) */}}
{{- define "cleave.internalSecretEnv" -}}
{{- if dig "internal_secret_env" "" (.plan.router | default dict) }}
- name: CLEAVE_INTERNAL_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ .ctx.Values.internalSecret.name }}
      key: {{ .ctx.Values.internalSecret.key }}
{{- end }}
{{- end -}}

{{- define "cleave.labels" -}}
app.kubernetes.io/name: cleave
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: cleave-{{ .Chart.Version }}
{{- end -}}

{{/* Selector labels of one role: (dict "ctx" $ "role" "shard"). */}}
{{- define "cleave.selector" -}}
app.kubernetes.io/name: cleave
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{/* A shard's or ranker's stable address: (dict "ctx" $ "role" "shard" "index" 0 "port" 7000). */}}
{{- define "cleave.podAddress" -}}
{{- $name := printf "%s-%s" .ctx.Release.Name .role -}}
{{- printf "%s-%d.%s.%s.svc:%d" $name (int .index) $name .ctx.Release.Namespace (int .port) -}}
{{- end -}}

{{/* Requests and limits of a role kind from the plan (docs/deploy.md, "Resources"):
CPU: the most threads of a role of that kind; memory: the smallest share of a host among the
hosts running that kind (the host's memory divided by the roles on it), as request and limit;
a GPU for cuda rankers. (dict "plan" $plan "kind" "shards" "cpu" N "gpu" bool "override" map) */}}
{{- define "cleave.resources" -}}
{{- if .override -}}
{{- toYaml .override -}}
{{- else -}}
{{- $plan := .plan -}}
{{- $all := concat $plan.shards $plan.rankers $plan.routers -}}
{{- $mem := -1.0 -}}
{{- range $role := index $plan .kind -}}
{{- $n := 0 -}}
{{- range $other := $all -}}
{{- if eq $other.host $role.host }}{{ $n = add1 $n }}{{ end -}}
{{- end -}}
{{- range $h := $plan.hosts -}}
{{- if eq $h.name $role.host -}}
{{- $share := floor (divf (mulf $h.memory_gib 1024) $n) -}}
{{- if or (lt $mem 0.0) (lt $share $mem) }}{{ $mem = $share }}{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}
requests:
  cpu: {{ .cpu | quote }}
  memory: {{ printf "%dMi" (int $mem) }}
limits:
  memory: {{ printf "%dMi" (int $mem) }}
{{- if .gpu }}
  nvidia.com/gpu: 1
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The bundle volume and, when fetched, the init container. */}}
{{- define "cleave.bundleVolume" -}}
- name: bundle
{{- if .Values.bundle.pvc }}
  persistentVolumeClaim:
    claimName: {{ .Values.bundle.pvc }}
    readOnly: true
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.bundle.fetch.sizeLimit }}
{{- end }}
- name: config
  configMap:
    name: {{ .Release.Name }}-config
{{- end -}}

{{- define "cleave.bundleMount" -}}
- name: bundle
  mountPath: /bundle
  readOnly: true
{{- with .Values.bundle.subPath }}
  subPath: {{ . }}
{{- end }}
- name: config
  mountPath: /etc/cleave
  readOnly: true
{{- end -}}

{{- define "cleave.initContainers" -}}
{{- if not .Values.bundle.pvc }}
initContainers:
- name: fetch-bundle
  image: {{ .Values.bundle.fetch.image }}
  imagePullPolicy: {{ .Values.images.pullPolicy }}
  command: {{ toJson .Values.bundle.fetch.command }}
  env:
  - {name: BUNDLE_DIR, value: /bundle}
  volumeMounts:
  - {name: bundle, mountPath: /bundle}
{{- end }}
{{- end -}}

{{/* Liveness and readiness on a role's HTTP endpoints: (dict "ctx" $ "port" "metrics"). */}}
{{- define "cleave.probes" -}}
livenessProbe:
  httpGet: {path: /live, port: {{ .port }}}
  periodSeconds: {{ .ctx.Values.probes.periodSeconds }}
  failureThreshold: {{ .ctx.Values.probes.failureThreshold }}
readinessProbe:
  httpGet: {path: /ready, port: {{ .port }}}
  periodSeconds: {{ .ctx.Values.probes.periodSeconds }}
  failureThreshold: {{ .ctx.Values.probes.failureThreshold }}
{{- end -}}

{{- define "cleave.scheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:{{ toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:{{ toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
