"""Per-category SASS counts of the history loop (one 64-token step today, one 128-token step v2)."""
import collections, json, sys
from sass_count import parse, loops, counts

def history_loop(path):
    ins = parse(open(path).read())
    for lo, hi in loops(ins):
        c = counts(ins, lo, hi)
        if c.get("IGMMA.64x8x32.S8.S8") or c.get("HGMMA.64x8x16.F32"):
            return c

def cats(c):
    g = collections.OrderedDict()
    pick = lambda pred: sum(v for k, v in c.items() if pred(k))
    g["wgmma (HGMMA/IGMMA)"] = pick(lambda k: "GMMA" in k)
    g["wgmma arrive/wait"] = pick(lambda k: k.startswith("WARPGROUP"))
    g["LOP3 (decode masks + logic)"] = c.get("LOP3.LUT", 0)
    g["PRMT"] = c.get("PRMT", 0)
    g["I2F (quarter rate)"] = pick(lambda k: k.startswith("I2F"))
    g["MUFU (ex2, lg2, rcp)"] = pick(lambda k: k.startswith("MUFU"))
    g["fp16->fp32 scales (HADD2.F32)"] = c.get("HADD2.F32", 0)
    g["FFMA/FMUL/FADD"] = pick(lambda k: k.split(".")[0] in ("FFMA", "FMUL", "FADD"))
    g["FMNMX/FSEL/FSETP"] = pick(lambda k: k.split(".")[0] in ("FMNMX", "FSEL", "FSETP"))
    g["IMAD (int combine of k32 groups, addresses)"] = pick(lambda k: k.startswith("IMAD") and k != "IMAD.MOV.U32")
    g["register moves (IMAD.MOV/MOV/UMOV/CS2R)"] = pick(lambda k: k in ("IMAD.MOV.U32", "MOV", "UMOV", "CS2R"))
    g["SHFL"] = pick(lambda k: k.startswith("SHFL"))
    g["global loads (LDG/LDGSTS)"] = pick(lambda k: k.startswith("LDG"))
    g["shared loads (LDS/LDSM)"] = pick(lambda k: k.startswith("LDS"))
    g["shared stores (STS/STSM)"] = pick(lambda k: k.startswith("STS"))
    g["barriers/fences/depbar"] = pick(lambda k: k.startswith(("BAR", "MEMBAR", "FENCE", "DEPBAR")))
    g["spills (LDL/STL)"] = pick(lambda k: k.startswith(("LDL", "STL")))
    tot = sum(c.values())
    g["other (int/address/predicate/branch)"] = tot - sum(g.values())
    g["total"] = tot
    return g

rows = {}
for name, path, mult in (("today (64-token step) x2", "results_cpu36/today_sass.txt", 2),
                         ("v2 (q0p0)", "results_cpu36/sass_v2.txt", 1), ("v2_qp", "results_cpu36/sass_v2_qp.txt", 1),
                         ("v2_qp_rm", "results_cpu36/sass_v2_qp_rm.txt", 1), ("v2_qp_cp3", "results_cpu36/sass_v2_qp_cp3.txt", 1),
                         ("v2_qp_rm_pa (unmeasured)", "results_cpu36/sass_v2_qp_rm_pa.txt", 1)):
    g = cats(history_loop(path))
    rows[name] = {k: v * mult for k, v in g.items()}
keys = list(next(iter(rows.values())).keys())
print("| per 128 tokens, per thread | " + " | ".join(rows) + " |")
print("|---|" + "---:|" * len(rows))
for k in keys:
    print(f"| {k} | " + " | ".join(str(rows[n][k]) for n in rows) + " |")
json.dump(rows, open("results_cpu36/categories.json", "w"), indent=1)
