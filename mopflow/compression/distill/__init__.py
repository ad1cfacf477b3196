"""Distillation of an ensemble into a student: transfer sets (MUNGE, mixup), the student's job."""
