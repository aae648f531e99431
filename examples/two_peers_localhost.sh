#!/usr/bin/env bash
# A bootstrap node and two peers of region "eu" on 127.0.0.1: the smallest real swarm.
# Usage (inside the activated venv): bash examples/two_peers_localhost.sh [WORKDIR]
set -euo pipefail

WORK="${1:-$(mktemp -d -t worldlm-two-peers-XXXXXX)}"
mkdir -p "$WORK"
DATA="$(python -c 'from worldlm_p2p.train import demo_data_dir; print(demo_data_dir())')/eu"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A tiny run: ~0.9M-parameter model, a region round every 10 local steps, loopback timings.
cat > "$WORK/run.toml" <<'EOF'
run_id = "two-peers"
[model]
preset = "tiny"
[train]
batch_size = 4
seq_len = 128
inner_steps = 10
EOF

worldlm-bootstrap --run-config "$WORK/run.toml" --host-maddrs /ip4/127.0.0.1/tcp/0 \
    --identity "$WORK/bootstrap.id" > "$WORK/bootstrap.log" 2>&1 &
PIDS+=($!)
# Its first stdout line is "To join this swarm: worldlm-peer --region REGION --initial-peers <maddr>"
for _ in $(seq 120); do
    MADDR="$(grep -m 1 '^To join this swarm' "$WORK/bootstrap.log" | grep -o '/ip4/[^ ]*/p2p/[^ ]*' || true)"
    [ -n "$MADDR" ] && break
    kill -0 "${PIDS[0]}" 2>/dev/null || { cat "$WORK/bootstrap.log"; exit 1; }
    sleep 0.5
done
[ -n "$MADDR" ] || { echo "bootstrap did not print its address" >&2; exit 1; }
echo "bootstrap node: $MADDR"

PEERS=()
for sub in de_news-reviews-wiki fr_blog-news-reviews-wiki; do
    worldlm-peer --region eu --initial-peers "$MADDR" --data "$DATA/$sub" --label "eu-$sub" \
        --max-steps 40 --threads 1 --device cpu --checkpoint-dir "$WORK/ckpt/$sub" \
        --summary "$WORK/$sub.json" > "$WORK/$sub.log" 2>&1 &
    PEERS+=($!); PIDS+=($!)
done
echo "peers started; logs in $WORK/*.log"
status=0
for pid in "${PEERS[@]}"; do wait "$pid" || status=1; done

for sub in de_news-reviews-wiki fr_blog-news-reviews-wiki; do
    grep -E "joined run|round [0-9]+:|checkpoint written|done:" "$WORK/$sub.log" | tail -n 4 || true
    python -c 'import json, sys; s = json.load(open(sys.argv[1])); print(json.dumps({k: s[k] for k in ("label", "region", "steps", "tokens", "rounds_completed", "group_sizes", "first_train_loss", "last_train_loss", "valid_loss")}))' "$WORK/$sub.json" || status=1
done
exit "$status"
