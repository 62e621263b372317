#!/usr/bin/env bash
# Elastic mode on one machine (README "Elastic mode"):
#
#     bash examples/elastic_demo.sh            # 4 ranks on 2 "nodes"; node B dies at step 60
#     STEPS=400 DIE_AT=100 bash examples/elastic_demo.sh --task text
#
# What runs: a store process (the head node: the c10d TCPStore must outlive every node that can
# fail), node A = ranks 0 and 1, node B = ranks 2 and 3, and a spare node C whose two processes
# are started with XIRANG_JOIN=1 as ranks 2 and 3. All train examples/train.py --elastic
# (digits by default) with the bf16 hook. At step $DIE_AT both ranks of node B SIGKILL
# themselves, as if the machine had died: the survivors notice, agree on the live ranks, rebuild
# the ring and train on with the global batch cut over them; at the next admission (every 20
# steps) node C takes ranks 2 and 3, receives the model and optimizer state, and the ring grows
# back to 4 ranks. The lowest live rank prints the mean training loss every 20 steps; the loss
# keeps falling through both changes.
# Set-up as examples/demo.sh (tests/setup_env.sh). Arguments go to examples/train.py.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../tests/setup_env.sh
source "$here/../tests/setup_env.sh" || { echo "elastic demo: set-up failed" >&2; exit 1; }
if [ "$XIRANG_AVAILABLE" != 1 ]; then
    echo "elastic demo: xirang is not available: $XIRANG_BUILD_ERROR" >&2
    exit 1
fi
cd "$XIRANG_ROOT"

steps="${STEPS:-200}"
die_at="${DIE_AT:-60}"
port="$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
out="$(mktemp -d)"
pids=()
cleanup() { kill -KILL "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT

# The head node's store: serves until this script ends.
"$PY" -c "
import datetime, time, torch.distributed as dist
s = dist.TCPStore('127.0.0.1', $port, is_master=True, wait_for_workers=False,
                  timeout=datetime.timedelta(seconds=600))
time.sleep(10**6)" &
pids+=($!)

common=(XIRANG_ELASTIC=1 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" WORLD_SIZE=4
        TORCHELASTIC_USE_AGENT_STORE=True OMP_NUM_THREADS=1)
args=(examples/train.py --elastic --steps "$steps" --die-at "$die_at" --die-ranks 2,3
      --admit-every 20 --log-every 20 --no-progress --summary "$out/summary.json" "$@")
node_b=()
for r in 0 1 2 3; do
    env "${common[@]}" RANK=$r LOCAL_RANK=$((r % 2)) "$PY" "${args[@]}" >"$out/rank$r.log" 2>&1 &
    pids+=($!)
    [ "$r" = 0 ] && rank0=$!
    if [ "$r" -ge 2 ]; then
        node_b+=($!)
        # Node B's ranks SIGKILL themselves at step $die_at: not jobs of this shell, or bash
        # reports each as "Killed"; the watcher below says what happened instead.
        disown $!
    fi
done
# Announces node B's (simulated) loss once both its ranks are gone; each logs the line first.
(
    for p in "${node_b[@]}"; do
        while kill -0 "$p" 2>/dev/null; do sleep 0.2; done
    done
    marker="simulating the loss of its node"
    if grep -q "$marker" "$out/rank2.log" && grep -q "$marker" "$out/rank3.log"; then
        echo "elastic demo: simulating the loss of node B: ranks 2 and 3 killed themselves (SIGKILL) at step $die_at" >&2
    else
        echo "elastic demo: node B's ranks 2 and 3 exited without the simulated loss; logs: $out/rank2.log, $out/rank3.log" >&2
    fi
) &
pids+=($!)
# The spare node C: two processes that wait in init_process_group until the live ranks admit
# them in ranks 2 and 3's places (DDP needs every rank, so both are admitted together).
spares=()
for r in 2 3; do
    env "${common[@]}" RANK=$r LOCAL_RANK=$((r % 2)) XIRANG_JOIN=1 "$PY" "${args[@]}" >"$out/spare$r.log" 2>&1 &
    pids+=($!)
    spares+=($!)
done

echo "elastic demo: 4 ranks + 2 spares, node B (ranks 2, 3) dies at step $die_at; logs in $out" >&2
tail -n +1 -f "$out/rank0.log" --pid "$rank0" | grep --line-buffered -E "^step |joined|rebuilt" >&2 &
rc=0
wait "$rank0" || rc=$?
if [ "$rc" != 0 ]; then
    echo "elastic demo: rank 0 failed (rc $rc); its log:" >&2
    tail -n 30 "$out/rank0.log" >&2
    exit "$rc"
fi
for p in "${spares[@]}"; do wait "$p" || rc=$?; done
sleep 0.2
echo "elastic demo: rank 0 and the spares exited ($rc); summary:" >&2
"$PY" - "$out/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
m = s["membership"]
print(f"final loss {s['final_loss']:.4f}, held-out accuracy {100 * s.get('heldout_accuracy', float('nan')):.2f} %, "
      f"live ranks {m['live']} (epoch {m['epoch']}, {m['recoveries']} changes), "
      f"last recovery {m['last_recovery_s']:.2f} s ({m['last_failure']})")
EOF
exit "$rc"
