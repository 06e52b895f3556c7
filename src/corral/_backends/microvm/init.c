/* PID 1 of a Corral microVM guest: mount the kernel filesystems, start the agent, reap, power off.
 *
 * The root is the template's read-only ext4 image on /dev/vda (kernel `root=/dev/vda ro
 * rootfstype=ext4 init=/corral/init`); the workspace disk (/dev/vdb) is mounted later by the
 * agent (`mount` op), because after a warm restore it is a different disk each time. Static, so
 * it does not depend on the template's libc. Any failure powers the guest off (QEMU runs with
 * -no-reboot, so a reboot ends QEMU) rather than leave a half-set-up guest for the host to wait
 * on: the host sees QEMU exit at once and reports the serial log's tail.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <time.h>
#include <net/if.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static void power_off(void) {
    sync();
    /* RB_AUTOBOOT, not RB_POWER_OFF: without ACPI the microvm machine has no power-off device,
     * and QEMU's -no-reboot turns the reset into an exit. */
    reboot(RB_AUTOBOOT);
    _exit(1);
}

static void die(const char *what) {
    fprintf(stderr, "corral-init: %s: %s\n", what, strerror(errno));
    power_off();
}

static void mount_or_die(const char *src, const char *dst, const char *type,
                         unsigned long flags, const char *data) {
    /* The root is read-only: the mount points exist in the image (rootimage.py makes them). */
    if (mount(src, dst, type, flags, data) != 0 && errno != EBUSY) {
        char what[256];
        snprintf(what, sizeof what, "mount %s (%s) on %s", src, type, dst);
        die(what);
    }
}

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, text, strlen(text));
    int saved = errno;
    close(fd);
    errno = saved;
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

static void enable_controllers(void) {
    /* One write per controller: pids and memory are what the agent's per-command limits rest
     * on, so they must be there; cpu only weights commands against each other. */
    if (write_file("/sys/fs/cgroup/cgroup.subtree_control", "+pids") != 0)
        die("enable the pids controller");
    if (write_file("/sys/fs/cgroup/cgroup.subtree_control", "+memory") != 0)
        die("enable the memory controller");
    if (write_file("/sys/fs/cgroup/cgroup.subtree_control", "+cpu") != 0)
        fprintf(stderr, "corral-init: no cpu controller: %s\n", strerror(errno));
}

static void loopback_up(void) {
    /* The egress tunnel listens on 127.0.0.1 inside; there is no other interface. */
    int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (sock < 0) die("socket for lo");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    if (ioctl(sock, SIOCGIFFLAGS, &ifr) != 0) die("SIOCGIFFLAGS lo");
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(sock, SIOCSIFFLAGS, &ifr) != 0) die("SIOCSIFFLAGS lo");
    close(sock);
}

/* There is no udev: make /dev/virtio-ports/<name> -> ../vportNpM, as udev's rule would. The
 * port's name arrives from QEMU a moment after the device is probed, so wait for the agent's
 * (bounded: without it the agent reports the missing channel and the guest powers off). */
static void name_virtio_ports(void) {
    mkdir("/dev/virtio-ports", 0755);
    for (int tries = 0; tries < 2000; tries++) {  /* 2000 x 5 ms = 10 s */
        int found = 0;
        DIR *dir = opendir("/sys/class/virtio-ports");
        struct dirent *entry;
        while (dir && (entry = readdir(dir)) != NULL) {
            if (entry->d_name[0] == '.') continue;
            char path[512], name[256], link[512], target[300];
            snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", entry->d_name);
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0) continue;
            ssize_t n = read(fd, name, sizeof name - 1);
            close(fd);
            if (n <= 0) continue;
            name[n] = 0;
            name[strcspn(name, "\n")] = 0;
            if (!name[0] || strchr(name, '/') || name[0] == '.') continue;
            snprintf(link, sizeof link, "/dev/virtio-ports/%s", name);
            snprintf(target, sizeof target, "../%s", entry->d_name);
            if (symlink(target, link) != 0 && errno != EEXIST) die("symlink a virtio port");
            if (strcmp(name, "corral.agent") == 0) found = 1;
        }
        if (dir) closedir(dir);
        if (found) return;
        struct timespec pause = {0, 5 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
    fprintf(stderr, "corral-init: no virtio port named corral.agent after 10 s\n");
}

int main(void) {
    /* The OOM killer inside the guest must pick a command, never init or the agent (the agent
     * inherits this across fork and exec; run.c raises it again for commands). */
    mount_or_die("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    if (write_file("/proc/self/oom_score_adj", "-1000") != 0) die("oom_score_adj");
    mount_or_die("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount_or_die("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                 "nsdelegate");
    enable_controllers();
    mount_or_die("devtmpfs", "/dev", "devtmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755");
    mkdir("/dev/pts", 0755);
    mount_or_die("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
                 "newinstance,ptmxmode=0666,mode=0620,gid=5");
    unlink("/dev/ptmx");
    if (symlink("pts/ptmx", "/dev/ptmx") != 0) die("symlink /dev/ptmx");
    mkdir("/dev/shm", 01777);
    mount_or_die("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777");
    mount_or_die("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777");
    mount_or_die("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "size=8m,mode=0755");
    loopback_up();
    sethostname("sandbox", 7);
    name_virtio_ports();

    pid_t agent = fork();
    if (agent < 0) die("fork");
    if (agent == 0) {
        char *argv[] = {"/usr/bin/python3", "-I", "-S", "/corral/agent.pyz", NULL};
        char *envp[] = {"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME=/workspace",
                        "LANG=C.UTF-8", NULL};
        execve(argv[0], argv, envp);
        die("exec /usr/bin/python3 (does the template have python3?)");
    }
    /* PID 1 reaps every orphan; when the agent itself ends, so does the guest. */
    for (;;) {
        int status;
        pid_t pid = wait(&status);
        if (pid == agent) {
            fprintf(stderr, "corral-init: the agent exited (status 0x%x); powering off\n",
                    status);
            break;
        }
        if (pid < 0 && errno == ECHILD) break;
    }
    power_off();
    return 0;
}
