"""The resume canary (``canary``: a job killed with SIGKILL anywhere resumes bitwise from its last save) and its job."""
