"""LoRA: ERNIE-Image LoRAs in every layout on the pack's MODEL, through core's weight adapters."""
