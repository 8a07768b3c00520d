import json, sys, time
from int8_decode import compile_offline
from sass_count import report, resource_usage
for name, kw in (("v2", {}), ("v2_p", dict(plo=True)), ("v2_qp", dict(qlo=True, plo=True)), ("v2_qp_rm", dict(qlo=True, plo=True, runmax=True)),
                 ("v2_qp_cp3", dict(qlo=True, plo=True, stages=3)), ("v2_qp_rm_cp3", dict(qlo=True, plo=True, stages=3, runmax=True)),
                 ("v2_qp_r96", dict(qlo=True, plo=True, maxnreg=96)),
                 ("v2_qp_rm_pa", dict(qlo=True, plo=True, runmax=True, page_ahead=True))):
    ck = compile_offline(**kw)
    res, sass = report(ck.asm["cubin"])
    open(f"results_cpu36/sass_{name}.txt", "w").write(sass)
    open(f"results_cpu36/{name}.ptx", "w").write(ck.asm["ptx"])
    l = max(res["loops"], key=lambda l: l["n"])
    sp = sum(v for k, v in l["ops"].items() if k.startswith(("LDL", "STL")))
    print(json.dumps({"name": name, "kw": kw, "resource": resource_usage(ck.asm['cubin']).splitlines()[-1].strip(), "shared": ck.metadata.shared,
                      "loop_instructions_per_128_tokens": l["n"], "spill_ops_in_loop": sp, "ops": l["ops"]}), flush=True)
