"""A local stand-in for the Hugging Face Hub's API, for the push tests (no network)."""

import os
import shutil


class LocalHub:
    """Stands in for huggingface_hub.HfApi: repos are folders; each upload is kept as a commit."""

    def __init__(self, root, fail=False):
        self.root, self.fail, self.commits = root, fail, []

    def create_repo(self, repo_id, exist_ok=False):
        if self.fail:
            raise ConnectionError("hub unreachable")
        os.makedirs(os.path.join(self.root, repo_id), exist_ok=True)

    def upload_folder(self, repo_id, folder_path, commit_message):
        target = os.path.join(self.root, repo_id, f"commit{len(self.commits)}")
        shutil.copytree(folder_path, target)
        self.commits.append((commit_message, sorted(os.listdir(target))))
