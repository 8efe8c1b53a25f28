"""Desktops in Docker containers: ``envs/docker/Dockerfile`` builds the image (Debian, Xvfb,
openbox, xterm, Chromium, and our VM server); ``envs.docker.provider.DockerDesktop`` runs one
container per desktop through the Docker Engine API and restarts it between episodes."""
