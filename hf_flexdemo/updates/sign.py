"""``sign``: DeMo's rule. Each entry moves by ``lr`` in the direction of the decoded update (``sign=False``: by
``lr`` times the update itself).

With ``kernels='triton'`` a ``demo`` update arrives sparse (every replica's top-k coefficients): it is decoded and
applied in one fused pass per tile (:mod:`hf_flexdemo.kernels.sign_decode`), with no dense update in between.
"""

from __future__ import annotations

from ..kernels import sign_decoder
from ..schemes.base import StepContext
from .base import Decoded, UpdateRule


class SignRule(UpdateRule):
    name = "sign"

    def apply(self, decoded: list[Decoded], ctx: StepContext) -> None:
        for item in decoded:
            group = item.bucket.group
            sparse = item.sparse
            if item.dense is None and self.kernels_for(item.bucket) == "triton":
                params, lr, sign = item.bucket.params, group["lr"], group["sign"]
                sign_decoder()(params, sparse.parts, sparse.plan, mode=sparse.mode, lr=lr, sign=sign, decay=item.decay)
                continue
            update = item.update
            self.subtract(item, update.sign_() if group["sign"] else update)
