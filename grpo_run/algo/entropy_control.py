"""Adaptive entropy control (Skywork-OR1, TRL's `use_adaptive_entropy`): the entropy bonus's coefficient
is stepped towards keeping the policy's entropy at a target.

After each step with entropy H: c <- min(c + delta, c_max) when H <= target, else max(c - delta, c_min);
the next step applies c only while the last measured H is at or below the target (0 otherwise), so the
bonus acts against entropy collapse and never pushes an already diverse policy.
Plain floats in, plain floats out: the trainer calls these on host values it already has.
"""


def next_entropy_coef(
    coef: float, entropy: float, *, target: float, delta: float, low: float, high: float
) -> float:
    """The coefficient after a step whose mean token entropy was `entropy`, kept within [low, high]."""
    if entropy <= target:
        return min(coef + delta, high)
    return max(coef - delta, low)


def applied_entropy_coef(coef: float, last_entropy: float, *, target: float) -> float:
    """The coefficient a step's loss uses: `coef` while the last entropy is <= target, else 0 (a run
    starts with last_entropy = inf: no bonus until the first measurement, as TRL)."""
    return coef if last_entropy <= target else 0.0
