"""A slow, literal FlexDeMo that simulates every replica in one process: the test oracle.

It follows the update rule as written, tile by tile and replica by replica, and shares no
code with the fast path (its DCT matrix, tiling and decoding are rebuilt here). Only the
subset rules of Random and Striding are restated, since replicas must agree on them.

Use it on the local shards: ``params[i]`` is the starting value of one tensor (the same on
every replica) and ``step(grads)`` takes ``grads[replica][i]``. ``update='orthogonal'`` needs
whole matrices: ``gather_rows(local_update)`` returns the whole matrix and where this shard's
rows start in it (by default the shard is the whole matrix).
"""

from __future__ import annotations

import math

import torch

from ..config import default_update
from ..updates.orthogonal import NS_COEFFICIENTS, NS_STEPS, newton_schulz_dtype


def _divisor(n: int, limit: int) -> int:
    best = 1
    for d in range(1, min(n, limit) + 1):
        if n % d == 0:
            best = d
    return best


def _dct(n: int, dtype: torch.dtype) -> torch.Tensor:
    c = torch.empty(n, n, dtype=torch.float64)
    for k in range(n):
        scale = math.sqrt((1 if k == 0 else 2) / n)
        for i in range(n):
            c[k, i] = scale * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
    return c.to(dtype)


def _as_matrix(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        return t.reshape(1, 1)
    if t.dim() == 1:
        return t.reshape(1, -1)
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _tiles(rows: int, cols: int, chunk: int):
    a, b = _divisor(rows, chunk), _divisor(cols, chunk)
    return [(r, c, a, b) for r in range(0, rows, a) for c in range(0, cols, b)]


def _newton_schulz(g: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Muon's five quintic iterations in ``dtype``, after normalising in float32:
    X <- a X + (b X X^T + c (X X^T)^2) X."""
    x = g.to(torch.float32)
    x = (x / (x.norm() + torch.finfo(torch.float32).tiny)).to(dtype)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    a, b, c = NS_COEFFICIENTS
    for _ in range(NS_STEPS):
        xxt = x @ x.T
        x = a * x + (b * xxt + c * xxt @ xxt) @ x
    return x.T if transposed else x


class FlexDeMoReference:
    """Every replica of a list of tensors, stepped with FlexDeMo's rule (no weight decay groups)."""

    def __init__(self, params: list[torch.Tensor], replicas: int, gather_rows=None, **hp):
        self.hp = {
            "lr": 1e-3,
            "weight_decay": 0.0,
            "decay": 0.999,
            "topk": 32,
            "chunk": 64,
            "sign": True,
            "update": None,  # None: as FlexDeMoConfig resolves it
            "ns_dtype": "auto",
            "scheme": "demo",
            "replicate_every": 1,
            "rate": 1 / 128,
            "seed": 0,
            "inner_steps": 100,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            **hp,
        }
        if self.hp["update"] is None:
            self.hp["update"] = default_update(self.hp["scheme"], self.hp["sign"])
        self.replicas = replicas
        self.gather_rows = gather_rows or (lambda local: (local, 0))
        self.params = [[p.detach().clone() for p in params] for _ in range(replicas)]
        self.momenta = [[torch.zeros_like(p) for p in params] for _ in range(replicas)]
        self.anchor = [p.detach().clone() for p in params]
        self.outer_v = [torch.zeros_like(p) for p in params]
        self.adam = [[(torch.zeros_like(p), torch.zeros_like(p)) for p in params] for _ in range(replicas)]
        self.second = [[torch.zeros_like(p) for p in params] for _ in range(replicas)]  # update='adam'
        self.updates = [[0 for _ in params] for _ in range(replicas)]  # adam's t: updates with lr > 0
        self.t = 0

    def step(self, grads: list[list[torch.Tensor]]) -> None:
        hp, R = self.hp, self.replicas
        self.t += 1
        for r in range(R):
            for p in self.params[r]:
                p.mul_(1 - hp["lr"] * hp["weight_decay"])
        if hp["scheme"] == "diloco":
            return self._diloco(grads)
        for r in range(R):
            for m, g in zip(self.momenta[r], grads[r]):
                m.mul_(hp["decay"]).add_(g, alpha=hp["lr"])
        if self.t % hp["replicate_every"] != 0:
            return
        rule = {"demo": self._demo, "random": self._subset, "striding": self._subset, "full": self._full}
        if hp["scheme"] == "none":
            for r in range(R):
                for i in range(len(self.params[r])):
                    self._move(r, i, self.momenta[r][i].clone())
                    self.momenta[r][i].zero_()
            return
        for i in range(len(self.anchor)):
            rule[hp["scheme"]](i)

    def _move(self, r: int, i: int, update: torch.Tensor, where: torch.Tensor | None = None) -> None:
        """Replica ``r``'s parameter ``i`` takes the decoded ``update`` (at flat positions ``where``)."""
        hp, p = self.hp, self.params[r][i]
        flat = p.reshape(-1)
        at = torch.arange(flat.numel()) if where is None else where
        u = update.reshape(-1)
        rule = hp["update"]
        if rule == "orthogonal" and p.dim() != 2:  # what it does not orthogonalize takes the adam rule
            rule = "adam"
        if rule == "adam":
            if hp["lr"] == 0:
                return
            g = u / hp["lr"]
            v = self.second[r][i].reshape(-1)
            beta2 = hp["betas"][1]
            self.updates[r][i] += 1
            t = self.updates[r][i]
            for j in range(flat.numel()):
                v[j] = beta2 * v[j] + (1 - beta2) * g[j] ** 2
                flat[j] -= hp["lr"] * g[j] / ((v[j] / (1 - beta2**t)).sqrt() + hp["eps"])
        elif rule == "orthogonal":
            whole, start = self.gather_rows(update.reshape(p.shape))
            dtype = newton_schulz_dtype(hp["ns_dtype"], p.device)
            ortho = _newton_schulz(whole, dtype=dtype).float() * math.sqrt(max(whole.shape))
            p -= hp["lr"] * ortho[start : start + p.shape[0]].to(p.dtype)
        else:
            flat[at] -= hp["lr"] * (u.sign() if hp["sign"] else u)

    def _demo(self, i: int) -> None:
        hp, R = self.hp, self.replicas
        shape = self.anchor[i].shape
        mats = [_as_matrix(self.momenta[r][i]) for r in range(R)]
        rows, cols = mats[0].shape
        total = torch.zeros(rows, cols, dtype=mats[0].dtype)
        for r0, c0, a, b in _tiles(rows, cols, hp["chunk"]):
            left, right = _dct(a, mats[0].dtype), _dct(b, mats[0].dtype)
            k = min(hp["topk"], a * b)
            if hp.get("scale_topk"):  # topk's share of a full tile, rounded half up, at least 1
                k = max(1, min(a * b, math.floor(hp["topk"] * a * b / hp["chunk"] ** 2 + 0.5)))
            sums = torch.zeros(a * b, dtype=mats[0].dtype)
            counts = torch.zeros(a * b, dtype=mats[0].dtype)
            for r in range(R):
                tile = mats[r][r0 : r0 + a, c0 : c0 + b]
                coeffs = (left @ tile @ right.T).reshape(-1)
                picked = torch.argsort(coeffs.abs(), descending=True)[:k].sort().values
                sent = torch.zeros_like(coeffs)
                sent[picked] = coeffs[picked]
                tile -= left.T @ sent.reshape(a, b) @ right  # error feedback, in place in momentum r
                sums[picked] += coeffs[picked]
                counts[picked] += 1
            mean = sums / counts.clamp(min=1)  # over the replicas that sent each coefficient
            total[r0 : r0 + a, c0 : c0 + b] = left.T @ mean.reshape(a, b) @ right
        for r in range(R):
            self._move(r, i, total.reshape(shape))

    def _positions(self, numel: int, i: int) -> torch.Tensor:
        block = max(1, round(1 / self.hp["rate"]))
        if self.hp["scheme"] == "striding":
            offset = (self.t // self.hp["replicate_every"] - 1) % block
            return torch.tensor([j for j in range(numel) if j % block == offset], dtype=torch.int64)
        picks = []
        # Each tensor's own generator, seeded by (seed, step, its 1-based place among the parameters).
        generator = torch.Generator().manual_seed((self.hp["seed"] * 1_000_003 + self.t) * 1_000_033 + i + 1)
        draws = torch.rand(math.ceil(numel / block), generator=generator, dtype=torch.float64)
        for n, start in enumerate(range(0, numel, block)):
            size = min(block, numel - start)
            picks.append(start + min(int(draws[n] * size), size - 1))
        return torch.tensor(picks, dtype=torch.int64)

    def _subset(self, i: int) -> None:
        where = self._positions(self.anchor[i].numel(), i)
        values = [self.momenta[r][i].reshape(-1)[where].clone() for r in range(self.replicas)]
        mean = sum(values) / self.replicas
        for r in range(self.replicas):
            self.momenta[r][i].reshape(-1)[where] -= values[r]
            self._move(r, i, mean, where)

    def _full(self, i: int) -> None:
        mean = sum(self.momenta[r][i] for r in range(self.replicas)) / self.replicas
        for r in range(self.replicas):
            self.momenta[r][i].zero_()
            self._move(r, i, mean.clone())

    def _diloco(self, grads: list[list[torch.Tensor]]) -> None:
        hp, R = self.hp, self.replicas
        beta1, beta2 = hp["betas"]
        for r in range(R):
            for i, (p, g, (m1, m2)) in enumerate(zip(self.params[r], grads[r], self.adam[r])):
                m1.mul_(beta1).add_(g, alpha=1 - beta1)
                if hp["update"] == "orthogonal" and p.dim() == 2:  # Muon's inner step: Nesterov, orthogonalized
                    self._move(r, i, g + beta1 * (m1 - g))
                    continue
                m2.mul_(beta2).add_(g * g, alpha=1 - beta2)
                m1_hat = m1 / (1 - beta1**self.t)
                m2_hat = m2 / (1 - beta2**self.t)
                p.sub_(hp["lr"] * m1_hat / (m2_hat.sqrt() + hp["eps"]))
        if self.t % hp["inner_steps"] != 0:
            return
        mu = hp["outer_momentum"]
        for i in range(len(self.anchor)):
            delta = sum(self.anchor[i] - self.params[r][i] for r in range(R)) / R
            self.outer_v[i] = mu * self.outer_v[i] + delta
            new = self.anchor[i] - hp["outer_lr"] * (delta + mu * self.outer_v[i])
            self.anchor[i] = new.clone()
            for r in range(R):
                self.params[r][i].copy_(new)
