"""Finding a tool call in a model turn: the text of the first `<tag>...</tag>` block."""

import re


def tagged_block(text: str, tag: str) -> str | None:
    """The content of the first `<tag>…</tag>` in `text`; an opened block never closed runs to the end
    (a turn cut at its closing tag by the model's EOS still calls the tool). None: no block."""
    match = re.search(rf"<{tag}>(.*?)(?:</{tag}>|$)", text, flags=re.DOTALL)
    return None if match is None else match.group(1)
