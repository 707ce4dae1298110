"""Time to solve every optimal table with b ≤ 4, g ≤ 64, 1/p ∈ {16, …, 1024} (cold cache).

    .venv/bin/python bench/bench_tables.py
"""
import time

from thc_ps.proto import tables


def main():
    tables._solve_cached.cache_clear()
    configs = [(b, g, f"1/{q}") for b in range(1, 5) for g in range((1 << b) - 1, 65)
               for q in (16, 32, 64, 128, 256, 512, 1024)]
    t = time.perf_counter()
    for c in configs:
        tables.solve_table(*c)
    dt = time.perf_counter() - t
    print(f"{len(configs)} tables (b <= 4, g <= 64, 1/p in 16..1024) solved exactly in {dt:.3f} s "
          f"({dt / len(configs) * 1e3:.3f} ms each)")
    big = time.perf_counter()
    tables._solve_cached.cache_clear()
    tables.solve_table(8, 255, "1/32")
    print(f"largest single table (b=8, g=255): {time.perf_counter() - big:.3f} s")


if __name__ == "__main__":
    main()
