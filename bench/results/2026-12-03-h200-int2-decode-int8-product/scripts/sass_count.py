"""SASS opcode counts of a compiled Gluon kernel, per loop (offline, no GPU)."""
import re, subprocess, sys, os, tempfile, collections

def disasm(cubin: bytes) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    out = subprocess.run([tool, "-c", "-g", "-fun", "1", f.name] if False else [tool, "-c", f.name],
                         capture_output=True, text=True).stdout
    return out

def parse(sass: str):
    """[(index, label_or_None, opcode, text)] in order."""
    ins = []
    label = None
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L\w+|\w+):\s*$", line)
        if m:
            label = m.group(1)
            continue
        m = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            txt = m.group(2).strip()
            body = re.sub(r"^@!?U?P\w+\s+", "", txt)
            op = body.split()[0] if body else "?"
            ins.append((int(m.group(1), 16), label, op, txt))
            label = None
    return ins

def loops(ins):
    """Backward branches: (start_addr, end_addr) of each loop body."""
    addr_of_label = {}
    out = []
    for a, lab, op, txt in ins:
        if lab:
            addr_of_label[lab] = a
    for a, lab, op, txt in ins:
        if op.startswith("BRA"):
            m = re.search(r"(`\(([^)]+)\)|0x[0-9a-f]+)", txt)
            tgt = None
            if m and m.group(2):
                tgt = addr_of_label.get(m.group(2))
            elif m:
                tgt = int(m.group(1), 16)
            if tgt is not None and tgt < a:
                out.append((tgt, a))
    return out

def counts(ins, lo=None, hi=None):
    c = collections.Counter()
    for a, lab, op, txt in ins:
        if (lo is None or a >= lo) and (hi is None or a <= hi):
            c[op] += 1
    return c

def report(cubin: bytes, name=""):
    sass = disasm(cubin)
    ins = parse(sass)
    res = {"total": len(ins), "loops": []}
    for lo, hi in loops(ins):
        c = counts(ins, lo, hi)
        res["loops"].append({"start": hex(lo), "end": hex(hi), "n": sum(c.values()), "ops": dict(c.most_common())})
    return res, sass


def resource_usage(cubin: bytes) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    return subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout.strip()
