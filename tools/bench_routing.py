"""Launch shape of the decode step's MoE routing (kernels/decode_routing.py: top-k + expert alignment, two launches
per MoE layer): warps per program of each launch and rows per program, swept on a GPU.

Each config runs route_and_align on 48 layers' router logits (fp32 [T, 128], top-8, block_m 16, the int16 R3
record written too) captured in one CUDA graph; us per layer = replay time / 48 (CUDA events). Every config's
outputs (probabilities, ids, sorted ids, block experts, R3 record) must equal the default config's bit for bit.

    python tools/bench_routing.py [--batches 16,64,256] [--out results/routing.json]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from graph_timing import replay_us

LAYERS, EXPERTS, TOP_K, BLOCK_M = 48, 128, 8, 16


def run_layers(logits, routed):
    from megatron_qrl.kernels.decode_routing import route_and_align

    outs = []
    for i, x in enumerate(logits):
        probs, ids, r = route_and_align(x, TOP_K, BLOCK_M, routed=routed[:, i])
        outs.append((probs, ids, r.sorted_ids, r.block_expert))
    return outs


def compare(outs, ref, routed, ref_routed) -> dict:
    ints = all(torch.equal(o[i], r[i]) for o, r in zip(outs, ref) for i in (1, 2, 3)) and torch.equal(routed, ref_routed)
    close = all(torch.allclose(o[0], r[0], rtol=1e-6, atol=0) for o, r in zip(outs, ref))
    bitwise = all(torch.equal(o[0], r[0]) for o, r in zip(outs, ref))
    return {"same": ints and close, "ints_equal": ints, "probs_close": close, "probs_bitwise": bitwise}


def us_per_layer(logits, routed) -> tuple[float, list]:
    us, outs = replay_us(lambda: run_layers(logits, routed))
    return us / len(logits), [[t.clone() for t in o] for o in outs]


def main(argv=None) -> int:
    from megatron_qrl.kernels import decode_routing

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="16,64,256")
    p.add_argument("--warps", default="1,2,4")
    p.add_argument("--rows", default="0,1,2,4,8,16", help="rows per program (0: the default rule)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    default = dict(decode_routing.TUNING)
    res = {"device": torch.cuda.get_device_name(), "default": default, "batches": {}}
    for t in [int(b) for b in a.batches.split(",")]:
        logits = [torch.randn(t, EXPERTS, device="cuda", generator=g) for _ in range(LAYERS)]
        routed = torch.zeros(t, LAYERS, TOP_K, dtype=torch.int16, device="cuda")
        decode_routing.TUNING.update(default)
        base_us, ref = us_per_layer(logits, routed)
        ref_routed = routed.clone()
        rows = {}
        warps = [int(w) for w in a.warps.split(",")]
        for cw, sw, rp in itertools.product(warps, warps, [int(r) for r in a.rows.split(",")]):
            decode_routing.TUNING.update(count_warps=cw, scatter_warps=sw, rows_per_program=rp or None)
            routed.zero_()
            try:
                us, outs = us_per_layer(logits, routed)
                rows[f"{cw},{sw},{rp}"] = {"us_per_layer": round(us, 2), **compare(outs, ref, routed, ref_routed)}
            except Exception as e:  # noqa: BLE001 - e.g. a tile too large for a warp count: keep the sweep
                rows[f"{cw},{sw},{rp}"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        decode_routing.TUNING.update(default)
        ok = {k: v for k, v in rows.items() if v.get("same")}
        best = min(ok, key=lambda k: ok[k]["us_per_layer"]) if ok else None
        res["batches"][t] = {"default_us_per_layer": round(base_us, 2), "best": best,
                             "best_us_per_layer": ok[best]["us_per_layer"] if best else None, "configs": rows}
        bad = [(k, {f: v.get(f) for f in ("ints_equal", "probs_close", "error") if f in v})
               for k, v in rows.items() if not v.get("same")]
        print(f"[routing] T={t}: default {base_us:.2f} us/layer; best (count warps, scatter warps, rows/program) "
              f"{best}: {ok[best]['us_per_layer'] if best else '-'} us/layer; configs differing or failing: {bad}",
              flush=True)
        top = sorted(ok.items(), key=lambda kv: kv[1]["us_per_layer"])[:8]
        print("   fastest: " + "; ".join(f"{k} {v['us_per_layer']}" for k, v in top), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
