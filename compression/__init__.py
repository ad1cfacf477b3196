"""mopflow compression: top-k ensembles, distillation into a student, registration and promotion."""
