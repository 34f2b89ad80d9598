"""Uploads a folder to an S3 server (moto in native-runner/tests/it/remote.rs) with signed requests.

    python s3_upload.py ENDPOINT BUCKET PREFIX FOLDER

Creates BUCKET when missing and puts every file under FOLDER (hidden ones included: `.metadata`)
at `PREFIX/<relative path>`. Credentials and region come from the environment (AWS_*).
"""

import os
import sys

import boto3

endpoint, bucket, prefix, folder = sys.argv[1:5]
s3 = boto3.client("s3", endpoint_url=endpoint)
existing = [b["Name"] for b in s3.list_buckets().get("Buckets", [])]
if bucket not in existing:
    s3.create_bucket(Bucket=bucket)
count = 0
for dirpath, _, files in os.walk(folder):
    for name in files:
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, folder).replace(os.sep, "/")
        s3.upload_file(path, bucket, f"{prefix}/{rel}" if prefix else rel)
        count += 1
print(f"uploaded {count}")
