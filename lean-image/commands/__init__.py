"""The commands of ``leanimg``, one module each; ``leanimg.cli`` registers them on its group,
which imports a command's module only when that command runs or the help lists it. What they
share (exit codes, the IMAGE argument, --disk/--parent/-f, guarding outputs) is ``common``."""
