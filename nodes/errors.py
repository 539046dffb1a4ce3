"""The pack's error type: a message that names the thing and says what to do."""


class ErnieImageError(ValueError):
    """A user-facing problem with inputs, files or settings; ComfyUI shows the message as it is."""
