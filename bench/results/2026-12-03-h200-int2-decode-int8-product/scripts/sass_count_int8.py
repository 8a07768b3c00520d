import json, sys, collections
sys.path.insert(0, "/tmp/d2sass")
from sass_count import report, resource_usage, parse, disasm
from oscar_compile.kernels.attention_gluon_int8 import compile_offline
out = sys.argv[1]
for name, kw in (("int8_g4", {}), ("int8_g8", dict(num_q_per_kv=8)), ("int8_g1", dict(num_q_per_kv=1)),
                 ("int8_g4_hist", dict(has_hist=True)), ("int8_g4_det", dict(deterministic=True)), ("int8_g4_pdl", dict(pdl=True)), ("int8_g4_early", dict(early_load=True))):
    ck = compile_offline(**kw)
    res, sass = report(ck.asm["cubin"])
    open(f"{out}/sass_{name}.txt", "w").write(sass)
    loops = [l for l in res["loops"] if any(k.startswith("IGMMA") for k in l["ops"])]
    l = min(loops, key=lambda l: l["n"]) if loops else max(res["loops"], key=lambda l: l["n"])
    sp = sum(v for k, v in l["ops"].items() if k.startswith(("LDL", "STL")))
    print(json.dumps({"name": name, "kw": kw, "resource": resource_usage(ck.asm['cubin']).splitlines()[-1].strip(),
                      "shared": ck.metadata.shared, "loop_instructions_per_128_tokens": l["n"], "spill_ops_in_loop": sp,
                      "ops": l["ops"]}), flush=True)
