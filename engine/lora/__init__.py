"""Multi-LoRA: the adapters one engine serves (manager), their versions, loading from PEFT
directories, the adapter cache, and the slot buffers and weights the models apply."""
