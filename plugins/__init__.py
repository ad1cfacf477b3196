"""mopflow's Airflow plugin (the Sweeps page, the trigger guard), registered through the
``airflow.plugins`` entry point: any Airflow with mopflow installed loads it."""
