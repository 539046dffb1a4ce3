"""The pack's error type: a message that names the thing and says what to do; and how a message quotes text it did
not write."""

QUOTED_CHARS = 200  # a tensor name is some 60 characters; a model file may hold one of 8 MiB


class ErnieImageError(ValueError):
    """A user-facing problem with inputs, files or settings; ComfyUI shows the message as it is."""


def quoted(text: object, most: int = QUOTED_CHARS) -> str:
    """Text from a file or a workflow (a tensor name, a key), as a message shows it: as it is when short and
    printable; otherwise escaped (a newline cannot forge a log line) and cut to ``most`` characters, with its length
    said. An 8 MiB tensor name was echoed whole into an 8.4-million-character error."""
    text = str(text)
    head = text[: most + 1]
    shown = head if head.isprintable() else repr(head)[1:-1]
    if len(text) <= most and len(shown) <= most:
        return shown
    return f"{shown[:most]}… ({len(text)} characters)"
