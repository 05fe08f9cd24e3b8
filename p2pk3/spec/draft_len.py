"""How many tokens to draft for a session this pass (0 included).

`DraftLength` keeps the session's recent per-token acceptance rate alpha (decayed counts of accepted and
rejected drafts, with a prior; without drafts it drifts back to the prior, so a session that stopped
speculating tries again later). A pass with k drafts settles E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens
in expectation (the accepted prefix + the bonus token). `PassCost` is the measured ring time of a pass by
batch width (EMA per width; interpolated between measured widths, extrapolated linearly beyond). The
choice maximises E(k) / T(width of the rest of the batch + 1 + k): expected tokens per unit of ring time.
When passes cost the same at any small width (a memory-bound GPU ring) that means long drafts; when the
cost grows with the width (small models on CPUs) only well-predicted sessions draft."""

from __future__ import annotations

from typing import Callable


class PassCost:
    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self.ms: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def observe(self, width: int, ms: float) -> None:
        self.ms[width] = ms if width not in self.ms else self.decay * self.ms[width] + (1 - self.decay) * ms
        self.count[width] = self.count.get(width, 0) + 1

    def estimate(self, width: int) -> float | None:
        """Ring time (ms) of a pass of `width` tokens; None before any measurement."""
        if not self.ms:
            return None
        if width in self.ms:
            return self.ms[width]
        ws = sorted(self.ms)
        lo = [w for w in ws if w < width]
        hi = [w for w in ws if w > width]
        if lo and hi:
            a, b = lo[-1], hi[0]
            t = (width - a) / (b - a)
            return self.ms[a] * (1 - t) + self.ms[b] * t
        if len(ws) >= 2:  # least-squares line through the measured widths, never decreasing
            n = len(ws)
            mx, my = sum(ws) / n, sum(self.ms[w] for w in ws) / n
            var = sum((w - mx) ** 2 for w in ws)
            slope = max(0.0, sum((w - mx) * (self.ms[w] - my) for w in ws) / var)
            ref = lo[-1] if lo else hi[0]
            return max(self.ms[ref] + slope * (width - ref), 1e-6)
        w0 = ws[0]  # one width measured: assume a mild growth (optimistic, so longer drafts get measured)
        return self.ms[w0] * (1 + 0.05 * (width - w0) / max(w0, 1))

    def table(self) -> dict[str, float]:
        return {str(w): round(v, 3) for w, v in sorted(self.ms.items())}


class DraftLength:
    def __init__(self, prior_alpha: float = 0.5, prior_weight: float = 2.0, decay: float = 0.8):
        self.a0, self.r0 = prior_alpha * prior_weight, (1 - prior_alpha) * prior_weight
        self.decay = decay
        self.acc = 0.0
        self.rej = 0.0

    @property
    def alpha(self) -> float:
        return (self.acc + self.a0) / (self.acc + self.rej + self.a0 + self.r0)

    def observe(self, proposed: int, accepted: int) -> None:
        """One pass: `accepted` of `proposed` drafted tokens (0, 0: a pass without drafts)."""
        self.acc = self.decay * self.acc + accepted
        self.rej = self.decay * self.rej + (1.0 if accepted < proposed else 0.0)

    def expected(self, k: int) -> float:
        a = min(self.alpha, 1 - 1e-9)
        return (1 - a ** (k + 1)) / (1 - a)

    def choose(self, kmax: int, cost: Callable[[int], float | None]) -> int:
        """k in 0..kmax maximising expected tokens per ring time; `cost(k)`: ring ms with k drafts."""
        if kmax <= 0:
            return 0
        best, best_rate = 0, -1.0
        for k in range(kmax + 1):
            c = cost(k)
            if c is None:  # nothing measured yet: draft the most
                return kmax
            rate = self.expected(k) / max(c, 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = k, rate
        return best
