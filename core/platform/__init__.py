"""What the machine the engine runs on can do: the CPU's instruction-set probe and the choices made from it."""
