"""The memory-efficiency factor ``E`` of the MemoryUpdate reward, ``r = ΔS * E`` with ``ΔS = S(final) - S(initial)``.

Upstream (Astera-org/memupdate ``memory_reward.py``) hard-coded the constants below. Every one is a field of
:class:`memupdate.settings.EfficiencyConfig` (the reward's ``efficiency`` settings), with upstream's value as its default except two.

``E`` never amplifies: it is at most 1 (``max_factor`` and ``density_cap`` may not exceed 1; upstream's
1.5 and 1.2). Upstream's density factor paid up to 1.2x a gain for memories longer than before, but S reads
a fixed budget of the reader's text (:func:`memupdate.prompts.within_budget`), so longer memories bring the
reader nothing more: above 1, ``E`` paid for length itself. ``E`` only discounts gains that bloat or churn
the store.

Upstream multiplied every ``ΔS`` by ``E``. With ``E`` in [0.1, 1.5], a harmful trajectory that also
bloated the store (small ``E``) was then punished *less* than the same harm done compactly. Here ``E``
scales gains only (``apply_to: positive``); upstream's product is ``apply_to: always``.

One upstream constant is a trap: ``max_total_memories = 100`` is below the size of every LoCoMo
conversation's observation set (169 to 324), so the size factor already shrinks every reward before the
agent does anything. ``max_total_memories=None`` measures size growth against the initial count instead;
``config/config.yaml`` uses that.
"""

from __future__ import annotations

from memupdate.settings import EfficiencyConfig

#: The reward's default efficiency settings.
DEFAULT_EFFICIENCY = EfficiencyConfig()


def efficiency_factor(
    n_initial: int,
    chars_initial: int,
    n_final: int,
    chars_final: int,
    config: EfficiencyConfig = DEFAULT_EFFICIENCY,
) -> dict[str, float]:
    """``E`` and its three factors, from the memory counts and total characters before and after.

    An unchanged store has E = 1 (with a size limit at or above its size):

    >>> efficiency_factor(50, 5000, 50, 5000)["efficiency"]
    1.0

    Growing from 150 to 180 memories of the same length, with upstream's limit of 100:
    size = max(0.1, 1 - 80/100) = 0.2; density = 1.0; change = max(0.8, 1 - 0.5 * 30/150) = 0.9.

    >>> f = efficiency_factor(150, 15000, 180, 18000)
    >>> round(f["size_factor"], 3), round(f["change_factor"], 3), round(f["efficiency"], 3)
    (0.2, 0.9, 0.18)

    An emptied store holds no information: density 0 (upstream divides its 0 characters by max(n, 1)).

    >>> efficiency_factor(150, 15000, 0, 0)["density_factor"]
    0.0
    """
    limit = config.max_total_memories if config.max_total_memories is not None else max(n_initial, 1)
    size = max(config.size_floor, 1.0 - (n_final - limit) / limit) if n_final > limit else 1.0
    if n_initial > 0:
        density = min(config.density_cap, (chars_final / max(n_final, 1)) / max(chars_initial / n_initial, 1.0))
    else:
        density = 1.0
    change = max(config.change_floor, 1.0 - config.change_slope * abs(n_final - n_initial) / max(n_initial, 1))
    efficiency = min(config.max_factor, max(config.min_factor, size * density * change))
    return {"efficiency": efficiency, "size_factor": size, "density_factor": density, "change_factor": change}


def apply_efficiency(delta: float, efficiency: float, config: EfficiencyConfig = DEFAULT_EFFICIENCY) -> float:
    """The reward from ``ΔS`` and ``E``: ``ΔS * E`` for a gain; a loss stays whole unless ``apply_to: always``.

    >>> apply_efficiency(0.5, 0.2), apply_efficiency(-0.5, 0.2)
    (0.1, -0.5)
    >>> apply_efficiency(-0.5, 0.2, EfficiencyConfig(apply_to="always"))
    -0.1
    """
    if delta > 0 or config.apply_to == "always":
        return delta * efficiency
    return delta
