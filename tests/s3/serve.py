"""An S3-compatible server for the tests, on loopback: moto's standalone
server (moto.server.main) with IAM authentication switched on, so that a
wrong access key or secret is refused as S3 refuses it (403).

Before serving: one IAM user with the fixed test credentials below and an
allow-all policy, and the bucket `ckpt-test`, made in moto's backends of
this process (the server serves those). Run through serve.sh.
"""
import json
import sys

ACCESS_KEY_ID = "AKIACKPTSIDECARTEST1"
SECRET_ACCESS_KEY = "ckpt-sidecar-test-secret-not-a-real-one"
REGION = "us-east-1"
BUCKET = "ckpt-test"
ACCOUNT = "123456789012"  # moto's default account


def main() -> None:
    port = int(sys.argv[1])
    from moto import settings
    from moto.iam.models import iam_backends
    from moto.s3.models import s3_backends
    from moto.server import main as moto_main

    iam = iam_backends[ACCOUNT]["aws"]
    iam.create_user(REGION, "ckpt-test")
    iam.put_user_policy(
        "ckpt-test",
        "all",
        json.dumps({"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}),
    )
    key = iam.create_access_key("ckpt-test")
    # The key moto made is random; the tests use fixed ones.
    del iam.access_keys[key.physical_resource_id]
    key.access_key_id = ACCESS_KEY_ID
    key.secret_access_key = SECRET_ACCESS_KEY
    iam.access_keys[key.physical_resource_id] = key
    s3_backends[ACCOUNT]["aws"].create_bucket(BUCKET, REGION)
    # From now on every request is authenticated and authorised.
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0

    print(f"export AWS_ENDPOINT_URL=http://127.0.0.1:{port}")
    print(f"export AWS_ACCESS_KEY_ID={ACCESS_KEY_ID}")
    print(f"export AWS_SECRET_ACCESS_KEY={SECRET_ACCESS_KEY}")
    print(f"export AWS_REGION={REGION}")
    print("export AWS_ALLOW_HTTP=true")
    sys.stdout.flush()
    moto_main(["-H", "127.0.0.1", "-p", str(port)])


if __name__ == "__main__":
    main()
