#!/usr/bin/env bash
# Checks and measurements of the six-slot op on a CUDA machine, run from the repo root; logs and JSON under $OUT
# (default ./out/gpu). Usage: bash bench/run_gpu.sh [tests] [engine] [profile] [bench] [sweep] [ab]
# (default: tests profile sweep). Each step, in the order given:
#   tests    the op's GPU tests: kernels against the reference op, CUDA-graph capture, grouped projections,
#            the adapter files' leaf hash against hashlib
#   engine   the engine's GPU tests: greedy tokens equal to PEFT's, further methods, attention backends, penalties,
#            the fast load path (a LoRA served as its file's views, a bad file failing its load alone)
#   loadtests the adapter loader's tests on the GPU: the reads, their hash and gate, the loader's turns, staging
#            and prepared rows (an odd-rank B padded on the loader), loads beside steps and from other threads
#   e2e      bench/bench_engine.py --eager 64: the served step's table (engine_h200.json, e2e.log)
#   baselines bench/bench_engine.py --cases lora --batches 64 --peft --static: transformers + PEFT and static cache
#   rate     bench/bench_request_rate.py for each of $RATE_METHODS (default: ia3 vera): N = 64 on 8 layers,
#            $RATE_POPULARITY (default uniform), native vs rank-64 LoRA conversions, each within $RATE_TIMEOUT
#            seconds (default 420): rate_<method>[_zipf].json and .log (docs/performance.md's table)
#   rate1024 bench/bench_request_rate.py at N = $RATE_N (default 1024) adapters, $RATE_POPULARITY (default
#            uniform), on 4 layers (budget scaled to them), native vs rank-64 conversions, for each of $RATE_METHODS
#            (default: ia3 vera; one method at N = 1024 takes 4-7 minutes of a 10-minute call, and its 43 GB of
#            files are deleted after it): rate_<method>_<N>[_zipf].json and .log; RATE_PROFILE=224 adds a
#            cProfile of the steps of the runs at 224 req/s to the log
#   serving  bench/serve_bench.py: `scute serve` of the 8B shape with 64 adapters of the five methods under load
#            (serving.json, serving.log); the server's wheels the image lacks come from .whl (made by
#            `bash bench/gpu_wheels.sh`, carried with the call), installed under /tmp/site
#   compiles bench/bench_compiles.py: Triton compiles (on the step loop, on the adapter loader) and the running
#            requests' slowest step in bursts of new step sizes on IA3 adapters, 4 layers (compiles.json, compiles.log)
#   host     bench/bench_host_step.py: the engine's host time a decode step per request, forward stubbed, on this
#            machine's CPU (what bounds the host-bound 4-layer request-rate runs; host_step.json, host.log)
#   leafhash bench/bench_leaf_hash.py: an adapter file's hash-tree leaves by the GPU kernel and by hashlib on the
#            reader threads (leaf_hash.json)
#   load     bench/bench_adapter_load.py: each method's time from a PEFT folder to servable (adapter_load.json)
#   loadphases bench/profile_load.py --methods lora: a LoRA load's phases, synchronized one by one and as the loader
#            runs them, and the loader's longest stretches between pause points (profile_load.log)
#   background bench/bench_background_loads.py: the decode step while cold adapters load (background_loads.json)
#   sidestream bench/bench_side_stream.py: a step's input copies queued behind a side stream's copies, and its
#            kernels beside the loader's (side_stream.json, side_stream.log)
#   ablate   bench/bench_background_loads.py once per $ABLATE_VARIANTS (default: "none ungated-readers readers4 priority";
#            a variant is an --ablate value, "none" for none, readers<N>: --readers N, part<KB>: --part-kb KB (the
#            bytes a reader reads between two calls of the gate), or hashp<N>: --hash-programs N (the hash kernel's
#            programs at most)),
#            alternating for $ABLATE_ROUNDS rounds (default 1), on one machine: what each part of a load's work
#            costs the steps (background_<variant>_<round>.json, one line each; a run takes 80-120 s: four fit one call)
#   decode   bench/profile_decode.py: GPU time per kernel and idle gaps of graph-replayed decode steps (decode.json)
#   profile  bench/profile_ops.py: per-kernel times of one layer call (torch profiler)
#   bench    bench/bench_ops.py: the layer table of docs/performance.md (bench_ops.json, bench.log)
#   sweep    bench/bench_ops.py --sweep: times the SWEEP launch configurations on a few rows, then the table with
#            the best; prints each configuration's rows and the one chosen
#   ab       the same rows for each source tree in $AB_TREES (directories holding scute/ and bench/, e.g. made by
#            `git archive COMMIT scute bench | tar -x -C DIR`), one after the other on one machine, to compare
#            two versions of the code (rows: $AB_BATCHES tokens, $AB_ADAPTERS adapters, $AB_VARIANTS; defaults
#            below)
#   abrun    for each source tree in $AB_TREES (as for ab; inside the working tree and not git-ignored, so that it
#            is carried to the GPU machine), that tree's own `bash bench/run_gpu.sh $AB_STEPS` (default: load),
#            logs and JSON under $OUT/ab_<tree>_<round>; the trees alternate for $AB_ROUNDS rounds (default 1):
#            two versions of the engine's benches on one machine, whose host speed moves from machine to machine
set -u
OUT=$(realpath -m "${OUT:-out/gpu}")
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
steps=${*:-tests profile sweep}
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests) timeout 300 python3 -m pytest -q -x tests/ops/test_ops_triton.py tests/ops/test_ops_gpu.py tests/ops/test_ops_elementwise.py tests/ops/test_mapped.py \
             tests/ops/test_sha256.py tests/model/test_linear_groups.py > "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log" ;;
    engine) timeout 300 python3 -m pytest -q tests/engine/test_engine_gpu.py tests/engine/test_cuda_graph_gpu.py \
             tests/engine/test_penalties.py tests/adapters/test_peft_equality.py tests/adapters/test_fast_load.py tests/model/test_attention.py > "$OUT/engine.log" 2>&1; tail -3 "$OUT/engine.log" ;;
    loadtests) timeout 400 python3 -m pytest -q -x tests/ops/test_sha256.py tests/ops/test_table_writes.py tests/ops/test_mapped.py tests/adapters/test_fast_load.py \
             tests/engine/test_adapter_loading.py tests/engine/test_odd_rank_rows.py tests/ops/test_pool.py \
             tests/engine/test_engine_gpu.py tests/engine/test_cuda_graph_gpu.py > "$OUT/loadtests.log" 2>&1
             tail -3 "$OUT/loadtests.log" ;;
    e2e) timeout 560 python3 bench/bench_engine.py --eager 64 --out "$OUT/engine_h200.json" > "$OUT/e2e.log" 2>&1
         tail -22 "$OUT/e2e.log" ;;
    baselines) timeout 560 python3 bench/bench_engine.py --cases lora --batches 64 --new-tokens 32 --peft \
                 --peft-tokens 4 --static --out "$OUT/engine_baselines.json" > "$OUT/baselines.log" 2>&1
               tail -8 "$OUT/baselines.log" ;;
    rate) pop=${RATE_POPULARITY:-uniform}; suffix=; [ "$pop" = zipf ] && suffix=_zipf
          for m in ${RATE_METHODS:-ia3 vera}; do
            timeout ${RATE_TIMEOUT:-420} python3 bench/bench_request_rate.py --methods $m --adapters 64 --popularity $pop \
              --ranks 64 --layers 8 --convert 1 --requests 100 --bisect 2 --start-rate 8 --warm-arrivals 200 \
              --warm-rate 256 --min-duration 6 --out "$OUT/rate_$m$suffix.json" 2>&1 | grep -v Capturing \
              > "$OUT/rate_$m$suffix.log"; tail -4 "$OUT/rate_$m$suffix.log"
          done ;;
    rate1024) n=${RATE_N:-1024}; pop=${RATE_POPULARITY:-uniform}; name=$n; [ "$pop" = zipf ] && name=${n}_zipf
          for m in ${RATE_METHODS:-ia3 vera}; do
            timeout 570 python3 bench/bench_request_rate.py --methods $m --adapters $n --popularity $pop --ranks 64 \
              --layers 4 --max-adapters 1024 --adapter-memory-gib 1.75 --convert 1 --requests 100 --bisect 2 \
              --start-rate 8 --warm-arrivals 200 --warm-rate 256 --min-duration 6 --root /tmp/scute-rate-1024 \
              ${RATE_PROFILE:+--profile $RATE_PROFILE} --out "$OUT/rate_${m}_${name}.json" 2>&1 | tr '\r' '\n' | grep -v "Capturing\|files:" > "$OUT/rate_${m}_${name}.log"
            tail -4 "$OUT/rate_${m}_${name}.log"; rm -rf /tmp/scute-rate-1024
          done ;;
    serving) if ls .whl/*.whl > /dev/null 2>&1; then
               python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                 .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
             fi
             timeout 560 python3 bench/serve_bench.py --num-prompts 100 --out "$OUT/serving.json" > "$OUT/serving.log" 2>&1
             tail -12 "$OUT/serving.log" ;;
    compiles) timeout 300 python3 bench/bench_compiles.py --out "$OUT/compiles.json" 2>&1 | grep -v Capturing \
                > "$OUT/compiles.log"; tail -14 "$OUT/compiles.log" ;;
    leafhash) timeout 100 python3 bench/bench_leaf_hash.py --out "$OUT/leaf_hash.json" 2>&1 | tail -5 ;;
    host) timeout 200 python3 bench/bench_host_step.py --requests 32,128 --repeats 9 --out "$OUT/host_step.json" \
            > "$OUT/host.log" 2>&1; tail -6 "$OUT/host.log" ;;
    load) timeout 280 python3 bench/bench_adapter_load.py --device cuda --out "$OUT/adapter_load.json" > "$OUT/load.log" 2>&1
          tail -12 "$OUT/load.log" ;;
    loadphases) timeout 200 python3 bench/profile_load.py --methods lora > "$OUT/profile_load.log" 2>&1
                grep -A3 "^synchronized\|^as run" "$OUT/profile_load.log"; grep -A8 "stretches between" "$OUT/profile_load.log" ;;
    background) timeout 400 python3 bench/bench_background_loads.py --out "$OUT/background_loads.json" \
                  > "$OUT/background.log" 2>&1
                grep -E 'round [0-9]|GPU in the|"(quiet_median_ms|loading_p99_ms|p99_over_quiet_fit|load_latency_median_ms)"' \
                  "$OUT/background.log"; grep -A12 "longest stretches" "$OUT/background.log" | head -13 ;;
    sidestream) timeout 150 python3 bench/bench_side_stream.py --out "$OUT/side_stream.json" > "$OUT/side_stream.log" 2>&1
                tail -16 "$OUT/side_stream.log" ;;
    ablate) for round in $(seq "${ABLATE_ROUNDS:-1}"); do
              for v in ${ABLATE_VARIANTS:-none ungated-readers readers4 priority}; do
                a=(--ablate "$v"); [ "$v" = none ] && a=(); [[ "$v" = readers* ]] && a=(--readers "${v#readers}")
                [[ "$v" = part* ]] && a=(--part-kb "${v#part}")
                [[ "$v" = hashp* ]] && a=(--hash-programs "${v#hashp}")
                timeout 200 python3 bench/bench_background_loads.py "${a[@]}" \
                  --out "$OUT/background_${v}_$round.json" > "$OUT/background_${v}_$round.log" 2>&1
                python3 - "$OUT/background_${v}_$round.json" "$v" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(print(f"{sys.argv[2]:<20} no result (see its .log)"))
g = r["gpu"]
print(f"{sys.argv[2]:<20} quiet median {r['quiet_median_ms']:.2f}  loading p99 {r['loading_p99_ms']:.2f} ms  "
      f"p99/fit {r['p99_over_quiet_fit']:.3f}  slow {r['slow_steps']}/{r['loading_steps']}  GPU busy slow/other "
      f"{g.get('slow', {}).get('busy_median_ms', 0):.2f}/{g.get('other', {}).get('busy_median_ms', 0):.2f} ms  "
      f"latency {r['load_latency_median_ms']:.0f} ms")
t = r.get("gpu_slow_step_phases", {})  # the GPU-slow steps' thread times, median (in the other loading steps)
print(" " * 21 + "  ".join(f"{n} {t[n]['median_ms']:.2f} ({t[n]['other_steps_median_ms'] or 0:.2f})" for n in (
    "step loop CPU", "step loop run queue", "step loop blocked", "loader CPU", "readers CPU") if n in t))
PY
              done
            done ;;
    decode) timeout 300 python3 bench/profile_decode.py --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1
            grep -v "^{" "$OUT/decode.log" | tail -110 ;;
    profile) timeout 200 python3 bench/profile_ops.py > "$OUT/profile.log" 2>&1; grep -v "^expand\|^shrink\|^input" "$OUT/profile.log" | tail -40 ;;
    bench) timeout 400 python3 bench/bench_ops.py --out "$OUT/bench_ops.json" > "$OUT/bench.log" 2>&1; tail -25 "$OUT/bench.log" ;;
    sweep) timeout 500 python3 bench/bench_ops.py --sweep --out "$OUT/bench_ops.json" > "$OUT/bench.log" 2>&1
           python3 - "$OUT/bench_ops.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for row in r.get("sweep", []):
    if "error" in row or row["variant"] == "base":
        continue
    cfg = {k: row[k] for k in ("half_n", "warps", "tile_programs", "tile_items")}
    print(f"{row['batch']:>4} {row['adapters']:>3} {row['variant']:<13} {row['us']:8.1f} {row['delta_us'] or 0:8.1f} {cfg}")
print("chosen", r["config"])
PY
           tail -25 "$OUT/bench.log" ;;
    ab) for tree in ${AB_TREES:-}; do
          name=$(basename "$tree")
          (cd "$tree" && timeout 300 python3 bench/bench_ops.py --batches "${AB_BATCHES:-1,64,256}" --adapters "${AB_ADAPTERS:-1,64}" \
             --variants "${AB_VARIANTS:-base,lora,lora_grouped,vera,mix_grouped}" --out "$OUT/ab_$name.json" \
             > "$OUT/ab_$name.log" 2>&1)
          echo "== $name"; grep -E "^ +[0-9]+ +[0-9]+ " "$OUT/ab_$name.log" | head -60
        done ;;
    abrun) for round in $(seq "${AB_ROUNDS:-1}"); do
             for tree in ${AB_TREES:-}; do
               name=$(basename "$tree")
               echo "== $name, round $round"
               (cd "$tree" && OUT="$OUT/ab_${name}_$round" bash bench/run_gpu.sh ${AB_STEPS:-load})
             done
           done ;;
  esac
  echo "[$step: $(( $(date +%s) - start )) s]"
done
