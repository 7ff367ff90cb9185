"""hfgpt's CPU backend: C kernels and oneDNN products that make hfgpt's models fast on x86 CPUs."""
