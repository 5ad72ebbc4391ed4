"""Multi-LoRA: adapters from PEFT directories, their slot buffers and the adapter cache."""
