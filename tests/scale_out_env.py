"""What the tests of the scale-out profile share: an S3 server (moto's) with the profile's bucket,
and the environment their child processes start from."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from tests.conftest import PORT_RANGE_ENV

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BUCKET = "mopflow"  # the profile's bucket (infra/profiles/scale-out.env)
S3_CREDENTIALS = {  # what moto accepts; every process of a test uses them
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def s3_client(endpoint: str) -> Any:
    """A boto3 S3 client of the test's S3 server at ``endpoint``."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=S3_CREDENTIALS["AWS_DEFAULT_REGION"],
        aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )


def start_s3(address: str, cleanup: contextlib.ExitStack) -> str:
    """moto's S3 server on ``address``, on a port it binds itself (port 0) and reports, holding
    the profile's bucket; its endpoint URL. ``cleanup`` stops it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=address, port=0)
    server.start()
    cleanup.callback(server.stop)
    endpoint = f"http://{address}:{server.get_host_and_port()[1]}"
    s3_client(endpoint).create_bucket(Bucket=BUCKET)
    return endpoint


def child_env() -> dict[str, str]:
    """The environment a test's child process starts from: this one's without mopflow's,
    Airflow's and MLflow's settings (but the test worker's port range), with the S3 credentials,
    the venv's ``bin`` first on ``PATH`` and the checkout on ``PYTHONPATH``."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MOPFLOW_", "AIRFLOW", "MLFLOW_")) or k == PORT_RANGE_ENV
    }
    return (
        base | S3_CREDENTIALS | {"PATH": f"{BIN}{os.pathsep}{base.get('PATH', '')}", "PYTHONPATH": str(REPO)}
    )
