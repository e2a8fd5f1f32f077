#!/bin/busybox sh
# cleanroom initramfs /init: load the few modules the guest needs, mount the baseline's root
# filesystem (erofs, read-only) under a tmpfs overlay, and hand PID 1 to the guest agent.
# Every write of an episode lands in the tmpfs and dies with the VM.
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sys /sys
$B mount -t devtmpfs dev /dev
load() {
  for m in $($B cat "/lib/modules/$1"); do
    $B insmod "/lib/modules/$m.ko" 2>/dev/null || echo "cleanroom-init: insmod $m failed"
  done
}
load order
# the NIC's driver only in a VM that has one (a virtio device of type 1: network)
for d in /sys/bus/virtio/devices/*; do
  if [ "$($B cat "$d/device" 2>/dev/null)" = 0x0001 ]; then load order.nic; break; fi
done
i=0
while [ ! -b /dev/vda ] && [ $i -lt 500 ]; do $B usleep 10000; i=$((i+1)); done
# a failed step says so on the console and powers off (the host keeps the console as evidence)
fail() { echo "cleanroom-init: $*"; $B poweroff -f; $B sleep 5; }
$B mount -t erofs -o ro /dev/vda /lower || fail "cannot mount root image"
$B mount -t tmpfs -o mode=0755 tmpfs /upper || fail "cannot mount tmpfs"
$B mkdir -p /upper/data /upper/work
$B mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot \
  || fail "cannot mount overlay"
# The image may lack every folder the guest needs (a FROM scratch image, a lone static busybox),
# or hold a file or symlink in its place: the overlay's upper is a tmpfs, so each is made (or
# replaced) in the merged root, never in the image, and the agent needs nothing from it.
for d in dev proc sys run tmp; do
  if [ -L /newroot/$d ] || [ ! -d /newroot/$d ]; then
    m=0755; [ $d = tmp ] && m=1777
    $B rm -f /newroot/$d; $B mkdir -m $m /newroot/$d || fail "cannot make /$d"
  fi
done
$B mount --move /dev /newroot/dev || fail "cannot move /dev"
$B umount /proc /sys
# the pseudo file systems the agent and episodes expect (busybox is much cheaper than mount(8))
$B mount -t proc proc /newroot/proc || fail "cannot mount /proc"
$B mount -t sysfs sysfs /newroot/sys || fail "cannot mount /sys"
$B mount -t tmpfs -o mode=0755 tmpfs /newroot/run || fail "cannot mount /run"
$B mkdir -m 0755 /newroot/run/cleanroom
$B mkdir -p /newroot/dev/pts /newroot/dev/shm
$B mount -t devpts -o gid=5,mode=620 devpts /newroot/dev/pts
$B mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
# the native agent (static): nothing from the image
exec $B switch_root /newroot /opt/cleanroom/agent/agent
