"""Keys and values that were removed, and what replaced them: an old config that names one exits 2 saying
so, from Hydra's refusal (`hydra_errors`) or the door's (`convert`), instead of a bare "unknown key"."""

# A removed key, by its full name -> what replaced it.
REMOVED_KEYS: dict[str, str] = {
    "distill.kl_estimator": (
        "it was read only by distill.form=loss, which was removed: use distill.form=distribution (the exact "
        "divergence of the full next-token distributions; distill.jsd_beta: 1 reverse KL, 0 forward KL, "
        "between the generalized JSD)"
    ),
}

# A removed value of a key, (full key, value) -> what replaced it.
REMOVED_VALUES: dict[tuple[str, str], str] = {
    ("distill.form", "loss"): (
        "distill.form=loss (a k1/k3 estimate of the reverse KL on the sampled tokens, in the loss) was "
        "removed: "
        "use distill.form=distribution, the exact divergence of the full next-token distributions "
        "(distill.jsd_beta=1 is the reverse KL), or distill.form=advantage"
    ),
}


def removed_hint(full_key: str, value: object = None) -> str:
    """'distill.kl_estimator was removed: ...' for a removed key, or a removed value of a key; else ''."""
    if full_key in REMOVED_KEYS:
        return f"{full_key} was removed: {REMOVED_KEYS[full_key]}"
    if value is not None and (full_key, str(value).lower()) in REMOVED_VALUES:
        return REMOVED_VALUES[(full_key, str(value).lower())]
    return ""
