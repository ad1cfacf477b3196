"""The MLflow Model Registry: the pyfunc model, registration, promotion and rollback."""
