#!/bin/sh
# Build the tiny image the Docker tests use, with no registry: a busybox-static rootfs, docker-imported.
# Idempotent: does nothing when the image already exists. Usage: build.sh [IMAGE]  (needs busybox-static)
set -eu
IMAGE="${1:-batch-runner-test:latest}"
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "image $IMAGE already present"
    exit 0
fi
BUSYBOX="$(command -v busybox || true)"
if [ -z "$BUSYBOX" ] || ! "$BUSYBOX" --list >/dev/null 2>&1; then
    echo "busybox not found: install Debian's busybox-static" >&2
    exit 1
fi
ROOTFS="$(mktemp -d)"
trap 'rm -rf "$ROOTFS"' EXIT
mkdir -p "$ROOTFS/bin" "$ROOTFS/etc" "$ROOTFS/root" "$ROOTFS/tmp" "$ROOTFS/workspace" "$ROOTFS/usr"
cp "$BUSYBOX" "$ROOTFS/bin/busybox"
# Relative links, so they resolve inside the container (busybox --install would write host paths).
for applet in $("$BUSYBOX" --list); do
    [ -e "$ROOTFS/bin/$applet" ] || ln -s busybox "$ROOTFS/bin/$applet"
done
ln -s ../bin "$ROOTFS/usr/bin"
ln -s bin "$ROOTFS/sbin"
chmod 1777 "$ROOTFS/tmp"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$ROOTFS/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$ROOTFS/etc/group"
tar -C "$ROOTFS" -cf - . | docker import \
    --change 'ENV PATH=/bin:/usr/bin:/sbin' \
    --change 'WORKDIR /workspace' \
    --change 'CMD ["/bin/sh"]' \
    - "$IMAGE" >/dev/null
echo "built $IMAGE from $BUSYBOX"
