"""What the engine needs of its process: threads, the heap, the CPU's features."""
