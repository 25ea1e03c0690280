"""Newton-Schulz coefficients for fewer iterations: each iteration's odd quintic fitted to the interval it receives.

The orthogonal rule's iteration maps each singular value ``s`` (in ``[low, 1]`` after the update is divided by its
Frobenius norm) through ``p(s) = a s + b s^3 + c s^5`` per iteration. Muon uses one quintic five times. With fewer
iterations each can have its own: the one that keeps ``|1 - p(s)|`` smallest over the interval the previous
iterations leave (fitted greedily, the interval carried on). This prints, for 3, 4 and 5 iterations, the
coefficients (rounded to 4 decimals, as ``hf_flexdemo.updates.orthogonal.NS_SCHEDULES`` holds them) and the
interval ``[low, 1]`` ends up in, beside Muon's five::

    .venv/bin/python benchmarks/probes/ns_coefficients.py            # low = 1e-3; needs scipy
"""

from __future__ import annotations

import argparse

import numpy as np
from scipy.optimize import minimize

MUON = (3.4445, -4.7750, 2.0315)


def quintic(coefficients, s):
    a, b, c = coefficients
    return a * s + b * s**3 + c * s**5


def fit(low: float, high: float) -> np.ndarray:
    """The odd quintic closest to 1 over ``[low, high]`` (the largest distance is minimised)."""
    grid = np.geomspace(low, high, 4000)
    best = None
    for start in (MUON, (8.0, -22.0, 16.0), (2.0, -1.5, 0.5), (1.875, -1.25, 0.375)):
        found = minimize(
            lambda c: np.max(np.abs(1 - quintic(c, grid))),
            start,
            method="Nelder-Mead",
            options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 20000},
        )
        best = found if best is None or found.fun < best.fun else best
    return best.x


def interval_after(schedule, low: float) -> tuple[float, float]:
    """Where ``[low, 1]`` ends up through ``schedule`` (an iteration's quintic at a time)."""
    s = np.geomspace(low, 1.0, 20000)
    for coefficients in schedule:
        s = quintic(coefficients, s)
    return float(s.min()), float(s.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--low", type=float, default=1e-3, help="smallest singular value the fit covers")
    args = parser.parse_args()
    print(f"Muon x5: {MUON}; [{args.low:g}, 1] -> [%.3f, %.3f]" % interval_after([MUON] * 5, args.low))
    for steps in (3, 4, 5):
        schedule, low, high = [], args.low, 1.0
        for _ in range(steps):
            coefficients = np.round(fit(low, high), 4)
            schedule.append(tuple(float(c) for c in coefficients))
            low, high = interval_after(schedule, args.low)  # the next iteration's quintic is fitted to this
        print(f"{steps} fitted: {schedule}; [{args.low:g}, 1] -> [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main()
