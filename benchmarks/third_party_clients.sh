#!/usr/bin/env bash
# Third-party clients against `python -m engine.serve` (the tiny V4.1), each from its own virtual
# environment under /tmp: guidellm, aiperf and lm-eval (docs/serving.md, "Third-party clients").
# Not run in CI: it installs packages and takes minutes.
#
#   bash benchmarks/third_party_clients.sh [CLIENT...]    # default: every client in CLIENTS
#
# The server and the clients talk over 127.0.0.1 only, tokenizers load from the local checkpoint folder
# (never a hub), and every client sends a bounded number of requests. A client is a function run_NAME
# (add one, and its name to CLIENTS). Each writes its results under $OUT/NAME; the run ends with the
# server's response counts by status, where any 5xx fails it.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
OUT=${OUT:-/tmp/third_party_clients}
PORT=${PORT:-8399}
URL=http://127.0.0.1:$PORT
CLIENTS=(guidellm aiperf lmeval_chat)

# venv NAME PACKAGE...: /tmp/venv-NAME, made once; torch's CPU wheel goes in first, so that no client
# dependency pulls another build of it.
venv() {
    local dir=/tmp/venv-$1
    shift
    if [ ! -x "$dir/bin/$VENV_BIN" ]; then
        python3 -m venv "$dir"
        "$dir/bin/pip" install -q torch==2.13.0 >&2
        "$dir/bin/pip" install -q "$@" >&2
    fi
    echo "$dir"
}

run_guidellm() {  # synthetic prompts, streamed: chat at three request rates, then completions
    local bin run route rate
    bin=$(VENV_BIN=guidellm venv guidellm guidellm==0.8.1)/bin
    for run in chat/completions@0.5 chat/completions@1 chat/completions@2 completions@1; do
        route=${run%@*} rate=${run#*@}
        HF_HUB_OFFLINE=1 "$bin/guidellm" run --disable-console-interactive \
            --backend "kind=openai_http,target=$URL,model=tiny,request_format=/v1/$route" \
            --tokenizer "kind=huggingface_auto,model=$TINY" \
            --data kind=synthetic_text,prompt_tokens=64,output_tokens=16 \
            --profile "kind=constant,rate=$rate" \
            --constraint kind=max_requests,count=8 --constraint kind=max_duration,seconds=120 \
            --output "kind=json,path=$OUT/guidellm/${route/\//-}-$rate.json"
    done
}

run_aiperf() {  # streamed chat, then streamed completions, at a concurrency of 4; token counts from
    # the server's usage (the tiny model's random text does not re-tokenize to as many tokens)
    local bin endpoint
    bin=$(VENV_BIN=aiperf venv aiperf aiperf==0.13.0)/bin
    # A local folder is read as one; aiperf's offline switch would look for a hub cache entry instead.
    for endpoint in chat completions; do
        "$bin/aiperf" profile --ui-type none --model tiny --url "$URL" --endpoint-type $endpoint --streaming \
            --tokenizer "$TINY" --use-server-token-count --isl 64 --osl 16 --extra-inputs ignore_eos:true \
            --request-count 16 --concurrency 4 --output-artifact-dir "$OUT/aiperf/$endpoint"
    done
}

run_lmeval_chat() {  # a generate_until task from a local JSONL file over /v1/chat/completions
    local bin
    bin=$(VENV_BIN=lm_eval venv lmeval "lm-eval[api]==0.4.13")/bin
    (cd "$ROOT" && HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$bin/lm_eval" --model local-chat-completions \
        --model_args "model=tiny,base_url=$URL/v1/chat/completions,num_concurrent=2,max_retries=1,tokenizer_backend=None" \
        --tasks arithmetic_generate --include_path benchmarks/lm_eval_tasks --apply_chat_template \
        --output_path "$OUT/lmeval_chat")
}

cd "$ROOT"
mkdir -p "$OUT"
TINY=$($PYTHON -c "from model.testing.tiny import cached_tiny; print(cached_tiny('v41'))")
$PYTHON -m engine.serve "$TINY" --host 127.0.0.1 --port "$PORT" --served-model-name tiny \
    --max-model-len 2048 >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    curl -sf "$URL/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
    sleep 1
done

for client in "${@:-${CLIENTS[@]}}"; do
    echo "=== $client" >&2
    "run_$client" 2>&1 | tee "$OUT/$client.log"
done

echo "=== responses by status (deepseek:http_requests_total)"
curl -sf "$URL/metrics" | grep '^deepseek:http_requests_total' | tee "$OUT/statuses.txt"
! grep -q 'status="5' "$OUT/statuses.txt"
