#!/usr/bin/env bash
# The inference and management APIs with curl, against a TorchServe started from the repo root:
#   .venv/bin/torchrec-serve build --spec criteo --seed 0
#   .venv/bin/torchrec-serve build --spec criteo --seed 1 --version 2.0 --model-store /tmp/criteo-v2 \
#       && cp /tmp/criteo-v2/criteo.mar model_store/criteo_v2.mar
#   .venv/bin/torchserve --start --ncs --ts-config config/config.properties --model-store model_store
# then: bash examples/curl_walkthrough.sh      (stop with: .venv/bin/torchserve --stop)
set -euo pipefail
cd "$(dirname "$0")/.."
INF=http://127.0.0.1:8080
MGMT=http://127.0.0.1:8081
key() { python3 -c "import json; print(json.load(open('key_file.json'))['$1']['key'])"; }
M=(-H "Authorization: Bearer $(key management)")
I=(-H "Authorization: Bearer $(key inference)" -H "Content-Type: application/json")
step() { printf '\n== %s\n' "$*"; }

step "register criteo.mar (version 1.0), batching on"
curl -s "${M[@]}" -X POST "$MGMT/models?url=criteo.mar&batch_size=32&max_batch_delay=5&initial_workers=1&synchronous=true"

step "list and describe"
curl -s "${M[@]}" "$MGMT/models"
curl -s "${M[@]}" "$MGMT/models/criteo"

step "score one item, then 100 candidates"
curl -s "${I[@]}" --data @examples/requests/one_item.json "$INF/predictions/criteo"
curl -s "${I[@]}" --data @examples/requests/candidates_100.json "$INF/predictions/criteo" | head -c 200; echo

step "the same item in the KServe v2 / Open Inference Protocol form"
curl -s "${I[@]}" --data @examples/kserve_v2/one_item.json "$INF/v2/models/criteo/infer"; echo

step "what the worker runs (its describe answer)"
curl -s "${M[@]}" "$MGMT/models/criteo?customized=true"

step "scale to 2 workers"
curl -s "${M[@]}" -X PUT "$MGMT/models/criteo?min_worker=2&max_worker=2&synchronous=true"

step "a second version, scored explicitly, then made the default"
curl -s "${M[@]}" -X POST "$MGMT/models?url=criteo_v2.mar&initial_workers=1&synchronous=true"
curl -s "${I[@]}" --data @examples/requests/one_item.json "$INF/predictions/criteo/2.0"
curl -s "${M[@]}" -X PUT "$MGMT/models/criteo/2.0/set-default"
curl -s "${I[@]}" --data @examples/requests/one_item.json "$INF/predictions/criteo"

step "a bad request: 400 naming the field"
curl -s "${I[@]}" --data '{"items": [{"dense": [1, 2]}]}' "$INF/predictions/criteo"; echo

step "unregister both versions"
curl -s "${M[@]}" -X DELETE "$MGMT/models/criteo/1.0"
curl -s "${M[@]}" -X DELETE "$MGMT/models/criteo/2.0"
