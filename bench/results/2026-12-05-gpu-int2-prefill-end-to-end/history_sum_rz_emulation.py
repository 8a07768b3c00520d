"""Emulate the value sum of the folded history (acc = sum_n p_n s_n c_n, codes 0..3, minus the zero term
sum_n p_n s_n z_n) with an fp32 accumulator that rounds toward zero at each k-step of 16 products (the
tensor cores' truncating accumulation, an assumption), against float64, for n history tokens of flat
attention (bench.prefill_paged's data: scores ~0.1, scales U[0.02, 0.1], zeros U[0, 3])."""
import numpy as np

def rz(x64):
    r = x64.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(x64)
    r[over] = np.nextafter(r[over], np.float32(0))
    return r

def run(n, rows=16, d=32, promote=False, tile=128, k=16, seed=0):
    g = np.random.default_rng(seed)
    p = np.exp2(g.normal(0, 0.15, (rows, n)))           # flat softmax weights (unnormalised)
    s = g.uniform(0.02, 0.1, n); z = g.uniform(0, 3, n)
    c = g.integers(0, 4, (n, d)).astype(np.float64)
    pv = (p * s).astype(np.float16).astype(np.float64)  # rounded to the dots' dtype, as both terms use
    exact = (pv @ c - (pv @ z)[:, None]) / p.sum(1, keepdims=True)
    acc = np.zeros((rows, d), np.float32)
    part = np.zeros((rows, d), np.float32)
    for i in range(0, n, k):
        step = pv[:, i:i + k] @ c[i:i + k]              # products exact, one k-step
        if promote:
            part = rz(part.astype(np.float64) + step)
            if (i + k) % tile == 0 or i + k >= n:
                acc = (acc.astype(np.float64) + part).astype(np.float32)  # rounded to nearest
                part[:] = 0
        else:
            acc = rz(acc.astype(np.float64) + step)
    zacc = (pv @ z).astype(np.float32)
    got = (acc.astype(np.float64) - zacc[:, None]) / p.sum(1, keepdims=True)
    return np.linalg.norm(got - exact) / np.linalg.norm(exact)

for n in (8192, 32768, 131072):
    print(n, f"in the MMA: {run(n):.2e}", f"promoted per 128-token tile: {run(n, promote=True):.2e}")
