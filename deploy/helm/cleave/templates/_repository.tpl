{{/* Repository mode (repository.pvc set): one pod runs `cleave serve /repository`
(docs/deploy.md, "Serving a model repository"). */}}

{{/* The repository's settings, checked, as JSON: {"config": the `cleave serve --config`
table, "tokenEnv": the admin token's variable or "", "secretEnv": the internal secret's or ""}.
Keys are checked against the settings schema (files/settings.json); what the chart owns
(ports, address, TLS, tokens) is refused with where to set it instead. */}}
{{- define "cleave.repository" -}}
{{- $defaults := $.Files.Get "files/settings.json" | fromJson -}}
{{- $config := deepCopy (.Values.repository.config | default dict) -}}
{{- $sections := list "router" "shard" "ranker" -}}
{{- $owned := dict "host" "the pod listens on 0.0.0.0" "http_port" "ports.router" "grpc_port" "ports.routerGrpc" "tls_cert" "router.tlsSecret" "tls_key" "router.tlsSecret" "auth_token_file" "router.authTokenSecret" -}}
{{- range $key, $value := $config -}}
{{- if has $key $sections -}}
{{- if not (kindIs "map" $value) -}}
{{- fail (printf "repository.config.%s: expected a table of [%s] settings (docs/serving.md, \"Config file\"), got %v" $key $key $value) -}}
{{- end -}}
{{- $known := index $defaults $key -}}
{{- range $k, $_ := $value -}}
{{- if hasKey $owned $k -}}
{{- fail (printf "repository.config.%s.%s: the chart sets it; use %s instead" $key $k (index $owned $k)) -}}
{{- end -}}
{{- if not (hasKey $known $k) -}}
{{- fail (printf "repository.config.%s.%s: unknown key; known keys here: %s" $key $k (keys $known | sortAlpha | join ", ")) -}}
{{- end -}}
{{- end -}}
{{- else if hasKey $owned $key -}}
{{- fail (printf "repository.config.%s: the chart sets it; use %s instead" $key (index $owned $key)) -}}
{{- else if not (hasKey $defaults.serve $key) -}}
{{- fail (printf "repository.config.%s: unknown key; known keys here: %s, and the tables %s" $key (keys $defaults.serve | sortAlpha | join ", ") (join ", " $sections)) -}}
{{- end -}}
{{- end -}}
{{- /* 0 means this machine's memory, which in a pod is the node's, not the pod's limit:
a load would be admitted that the kernel then kills. */ -}}
{{- if not (gt (float64 ($config.table_memory_budget | default 0)) 0.0) -}}
{{- fail "repository.config.table_memory_budget: set it (bytes every version's shards may hold together, below repository.resources' memory): unset or 0 means the node's memory in a pod, not the pod's limit (docs/repository.md, \"Memory\")" -}}
{{- end -}}
{{- $requests := dig "requests" dict (.Values.repository.resources | default dict) -}}
{{- if not (and $requests.cpu $requests.memory) -}}
{{- fail "repository.resources.requests: set cpu and memory (e.g. {cpu: \"8\", memory: 64Gi}): the one pod runs every loaded version's shards and rankers, and is scheduled by its requests" -}}
{{- end -}}
{{- $router := $config.router | default dict -}}
{{- $_ := set $config "router" $router -}}
{{- $tokenEnv := $router.admin_token_env | default "" -}}
{{- if .Values.router.adminTokenSecret.name -}}
{{- $tokenEnv = $tokenEnv | default "CLEAVE_ADMIN_TOKEN" -}}
{{- $_ := set $router "admin_token_env" $tokenEnv -}}
{{- else if $tokenEnv -}}
{{- fail (printf "repository.config.router.admin_token_env is %q: set router.adminTokenSecret.name to a Secret holding the token" $tokenEnv) -}}
{{- end -}}
{{- $secretEnv := $router.internal_secret_env | default "" -}}
{{- if .Values.internalSecret.name -}}
{{- $secretEnv = $secretEnv | default "CLEAVE_INTERNAL_SECRET" -}}
{{- $_ := set $router "internal_secret_env" $secretEnv -}}
{{- else if $secretEnv -}}
{{- fail (printf "repository.config.router.internal_secret_env is %q: set internalSecret.name to a Secret holding the deployment's internal secret" $secretEnv) -}}
{{- end -}}
{{- if and .Values.repository.rollout .Values.router.tlsSecret -}}
{{- fail "repository.rollout with router.tlsSecret: the rollout Job speaks plain HTTP to the router; leave repository.rollout empty and run `cleave rollout` where your CA is trusted (docs/deploy.md, \"Serving a model repository\")" -}}
{{- end -}}
{{- toJson (dict "config" $config "tokenEnv" $tokenEnv "secretEnv" $secretEnv) -}}
{{- end -}}

{{/* One TOML value. Numbers arrive from values files as floats: a whole one is written as an
integer, which the config loader takes for integer and float settings alike. */}}
{{- define "cleave.tomlValue" -}}
{{- if kindIs "string" . -}}{{ toJson . }}
{{- else if kindIs "bool" . -}}{{ . }}
{{- else if kindIs "float64" . -}}{{ if eq (floor .) . }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- else if or (kindIs "int" .) (kindIs "int64" .) -}}{{ . }}
{{- else -}}{{ fail (printf "repository.config: expected a string, number or boolean, got %s %v" (kindOf .) .) }}
{{- end -}}
{{- end -}}

{{/* `cleave serve --config`'s TOML from the checked table: top-level keys, then [router],
[shard], [ranker]. */}}
{{- define "cleave.serveToml" -}}
# cleave serve --config (docs/serving.md, "Config file"), from repository.config.
{{- range $key := keys . | sortAlpha }}
{{- $value := index $ $key }}
{{- if not (kindIs "map" $value) }}
{{ $key }} = {{ include "cleave.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $section := list "router" "shard" "ranker" }}
{{- $table := index $ $section | default dict }}
{{- if $table }}

[{{ $section }}]
{{- range $key := keys $table | sortAlpha }}
{{ $key }} = {{ include "cleave.tomlValue" (index $table $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
