"""Registers, spills, shared memory and load widths of the adapter kernels on sm_90 (H100/H200), compiled on a
machine without a GPU: Triton compiles to PTX, the ptxas bundled with Triton assembles it with ``-v``, and its
nvdisasm shows the SASS, whose innermost tensor-core loop is counted (instructions per iteration / MMAs among
them). Also the adapter files' leaf-hash kernel (`scute.ops.sha256_kernels`: its global loads, vector and scalar).

Why: an SM holds 65536 registers, so a kernel of 4-warp programs at 255 registers runs 2 programs per SM, at 128
registers 4; at decode every program waits on a chain of dependent loads, and the programs in flight are what
hides it. The GPU profile (bench/profile_ops.py) reports the same numbers, at the price of device time.

Run: ``PYTHONPATH=. python bench/kernel_regs.py`` (about a minute on 2 cores). Note: Triton 3.9 writes PTX 9.4 and
its bundled ptxas (CUDA 12.9) reads up to 8.8; the kernels use nothing newer, so the version line is rewritten.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from scute.ops import kernels

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
NVDISASM = os.path.join(os.path.dirname(PTXAS), "nvdisasm")
TARGET = GPUTarget("cuda", 90, 32)

DELTA_ARGS = {"d0_ptr": "*fp32", "d1_ptr": "*fp32", "d2_ptr": "*fp32", "h_ptr": "*fp32", "tab_ptr": "*i64",
               "sorted_slots_ptr": "*i32", "sorted_ptr": "*i32", "tile_group_ptr": "*i32", "tile_start_ptr": "*i32",
               "tile_end_ptr": "*i32", "num_tokens": "i32", "num_slots": "i32", "h_width": "i32", "out0": "i32",
               "out1": "i32", "out2": "i32", "chunks_per_prog": "i32"}
SHRINK_ARGS = {"x_ptr": "*bf16", "h_ptr": "*fp32", "count_ptr": "*i32", "tab_ptr": "*i64", "sorted_ptr": "*i32",
               "tile_group_ptr": "*i32", "tile_start_ptr": "*i32", "tile_end_ptr": "*i32", "num_tokens": "i32",
               "in_features": "i32", "num_slots": "i32", "h_width": "i32", "k_per_split": "i32"}
EPILOGUE_ARGS = {"z0_ptr": "*bf16", "z1_ptr": "*bf16", "z2_ptr": "*bf16", "d0_ptr": "*fp32", "d1_ptr": "*fp32",
                 "d2_ptr": "*fp32", "tab_ptr": "*i64", "slots_ptr": "*i32", "num_slots": "i32", "out0": "i32",
                 "out1": "i32", "out2": "i32", "zst0": "i32", "zst1": "i32", "zst2": "i32", "chunks_per_prog": "i32"}
INPUT_ARGS = {"x_ptr": "*bf16", "xt_ptr": "*bf16", "tab_ptr": "*i64", "slots_ptr": "*i32", "count_ptr": "*i32",
              "num_tokens": "i32", "in_features": "i32", "num_slots": "i32", "tile_min": "i32"}
SHA256_ARGS = {"src": "*u8", "out": "*i32", "k_ptr": "*i32", "n_leaves": "i32", "phase": "i32"}
INPUT_TILE_ARGS = {"x_ptr": "*bf16", "xt_ptr": "*bf16", "tab_ptr": "*i64", "sorted_ptr": "*i32",
                   "sorted_slots_ptr": "*i32", "count_ptr": "*i32", "start_ptr": "*i32", "num_tokens": "i32",
                   "in_features": "i32", "num_slots": "i32", "tile_min": "i32"}


def compile_stats(fn, args: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 1,
                  unspecialized: tuple[str, ...] = ("chunks_per_prog", "target_items")) -> dict:
    """Compile `fn` for sm_90 as a launch on the bench's shapes would (pointers 16-byte aligned, sizes multiples
    of 16: Triton specialises both, but for the `unspecialized` arguments) and return its registers, spill bytes,
    global load/store widths and which tensor-core instruction its dots use."""
    signature = {**args, **{k: "constexpr" for k in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(args) if name not in unspecialized}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(re.sub(r"\.version \d+\.\d+", ".version 8.7", ptx, count=1))
        log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"], capture_output=True,
                             text=True, check=True).stderr
        sass = subprocess.run([NVDISASM, "-c", path + ".cubin"], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = re.search(r"(\d+) bytes spill stores", log)
    widths = Counter(re.findall(r"\b(ld\.global[\w.:]*|st\.global[\w.:]*)", ptx))
    return dict(regs=regs, spill_bytes=int(spill.group(1)) if spill else 0, shared_bytes=compiled.metadata.shared,
                programs_per_sm=min(65536 // (regs * 32 * num_warps), 32),
                vector_loads=sum(n for k, n in widths.items() if k.startswith("ld") and ".v" in k),
                scalar_loads=sum(n for k, n in widths.items() if k.startswith("ld") and ".v" not in k),
                mma="wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-", **mma_loop(sass))


def mma_loop(sass: str) -> dict:
    """The innermost loop of the SASS that holds tensor-core instructions (the body between a backward branch
    and its target): its instructions and its HMMA/HGMMA count, one iteration's static mix (a rank step of the
    multi-token delta, a K step of the shrink). An issue-bound loop wants few instructions per MMA."""
    labels, code, pending = {}, [], []
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;", line):
            addr = int(m.group(1), 16)
            labels.update({name: addr for name in pending})
            pending = []
            code.append((addr, m.group(2)))
    best = None
    for addr, text in code:
        m = re.search(r"BRA\s.*`\((\.L_x_\d+)\)", text)
        if m and labels.get(m.group(1), addr) < addr:
            body = [t for a, t in code if labels[m.group(1)] <= a <= addr]
            mma = sum(1 for t in body if re.search(r"\bH(G)?MMA\b", t))
            if mma and (best is None or len(body) < best[0]):
                best = (len(body), mma)
    return dict(loop_insts=best[0] if best else 0, loop_mma=best[1] if best else 0)


def main() -> None:
    rows = []
    tile_args = {**{k: v for k, v in DELTA_ARGS.items() if k != "chunks_per_prog"}, "multi_tiles_ptr": "*i32",
                 "num_multi_ptr": "*i32", "target_items": "i32"}
    for hb, warps in [(128, 4), (64, 2), (64, 1), (128, 1)]:
        cst = dict(B_TY=tl.bfloat16, P=3, SPLIT_K=4, BM=16, BR=16, BN=2 * hb, ONCE_ABOVE=16)
        rows.append((f"delta rows BN={2 * hb} warps={warps}",
                     compile_stats(kernels.delta_rows_kernel, DELTA_ARGS, cst, warps)))
    for hb, br, warps, stages in [(128, 16, 4, 1), (64, 64, 4, 1), (32, 64, 4, 1), (128, 16, 8, 1), (32, 128, 4, 1),
                                  (16, 256, 4, 1), (32, 256, 8, 1), (128, 32, 4, 1), (128, 16, 2, 1), (64, 64, 2, 1),
                                  (64, 64, 1, 1)]:
        cst = dict(B_TY=tl.bfloat16, P=3, BM=16, BR=br, BN=2 * hb, PREC="tf32")
        rows.append((f"delta tiles BN={2 * hb} BR={br} w={warps} st={stages}",
                     compile_stats(kernels.delta_tiles_kernel, tile_args, cst, warps, stages)))
    for hb, warps in [(64, 1), (128, 1), (256, 1), (256, 2)]:
        rows.append((f"epilogue HB={hb} warps={warps}",
                     compile_stats(kernels.epilogue_kernel, EPILOGUE_ARGS, dict(P=3, HB=hb), warps)))
    for bk, stages in [(128, 3), (64, 2)]:
        cst = dict(SPLIT_K=4, RT=1, BM=16, BR=16, BK=bk, PREC="tf32", ONCE_ABOVE=16)
        rows.append((f"shrink BK={bk} stages={stages}",
                     compile_stats(kernels.shrink_kernel, SHRINK_ARGS, cst, 4, stages)))
    for exact, iters, skip in ((False, 1, False), (True, 1, False), (True, 4, False), (True, 4, True)):
        cst = dict(BC=1024, BB=32, NBP=4, B_EXACT=exact, ITERS=iters, SKIP_TILED=skip)
        rows.append((f"input transform BB=32 exact={exact} it={iters} skip={skip}",
                     compile_stats(kernels.input_transform_kernel, INPUT_ARGS, cst, 4)))
    for exact in (False, True):
        cst = dict(BM=16, BB=32, NBP=2, B_EXACT=exact, PREC="tf32")
        rows.append((f"input tiles BB=32 NBP=2 exact={exact}",
                     compile_stats(kernels.input_tiles_kernel, INPUT_TILE_ARGS, cst, 4)))
    from scute.ops.sha256_kernels import sha256_leaves_kernel

    rows.append(("sha256 leaves LEAF=8192 BLOCK=32 w=1",
                 compile_stats(sha256_leaves_kernel, SHA256_ARGS, dict(LEAF=8192, BLOCK=32), 1,
                               unspecialized=("n_leaves", "phase"))))
    print(f"{'kernel':<40} {'regs':>5} {'spill B':>8} {'shared B':>9} {'progs/SM':>9} {'vec ld':>7} {'scalar ld':>10} "
          f"{'mma':>9} {'loop inst/mma':>14}")
    for name, s in rows:
        loop = f"{s['loop_insts']}/{s['loop_mma']}" if s["loop_mma"] else "-"
        print(f"{name:<40} {s['regs']:>5} {s['spill_bytes']:>8} {s['shared_bytes']:>9} {s['programs_per_sm']:>9} "
              f"{s['vector_loads']:>7} {s['scalar_loads']:>10} {s['mma']:>9} {loop:>14}")


if __name__ == "__main__":
    main()
