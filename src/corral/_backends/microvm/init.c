/* PID 1 of a Corral microVM guest: mount the shares, start the agent, reap, power off.
 *
 * Static, so it runs before the template's /usr (where libc and python3 live) is mounted: the
 * guest root is a tiny read-only skeleton over 9p and everything else arrives as shares named in
 * the kernel command line, which the kernel hands to init as the environment variable
 *   corral_mounts=TAG:/dest:ro,TAG:/dest:rw,...
 * Any failure powers the guest off (QEMU runs with -no-reboot, so it exits) rather than leave a
 * half-set-up guest for the host to wait on.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static void die(const char *what) {
    fprintf(stderr, "corral-init: %s: %s\n", what, strerror(errno));
    sync();
    reboot(RB_AUTOBOOT);
    _exit(1);
}

static void mount_or_die(const char *src, const char *dst, const char *type,
                         unsigned long flags, const char *data) {
    mkdir(dst, 0755);
    if (mount(src, dst, type, flags, data) != 0 && errno != EBUSY) {
        char what[256];
        snprintf(what, sizeof what, "mount %s on %s", src, dst);
        die(what);
    }
}

static void mount_shares(char *spec) {
    for (char *item = strtok(spec, ","); item; item = strtok(NULL, ",")) {
        char *tag = item, *dest = strchr(item, ':');
        if (!dest) { errno = EINVAL; die("corral_mounts entry"); }
        *dest++ = 0;
        char *mode = strchr(dest, ':');
        if (!mode) { errno = EINVAL; die("corral_mounts entry"); }
        *mode++ = 0;
        int ro = strcmp(mode, "ro") == 0;
        /* Read-only template shares never change under the guest, so it may cache them;
         * the workspace is written by the host's file API too, so it is never cached. */
        const char *opts = ro ? "trans=virtio,version=9p2000.L,msize=512000,cache=loose"
                              : "trans=virtio,version=9p2000.L,msize=512000";
        mount_or_die(tag, dest, "9p", ro ? MS_RDONLY | MS_NODEV | MS_NOSUID : MS_NODEV | MS_NOSUID,
                     opts);
    }
}

int main(void) {
    mount_or_die("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount_or_die("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount_or_die("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    mount_or_die("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=1777");
    mount_or_die("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "size=8m,mode=0755");
    const char *spec = getenv("corral_mounts");
    if (spec) {
        char *copy = strdup(spec);
        if (!copy) die("strdup");
        mount_shares(copy);
    }
    sethostname("sandbox", 7);

    pid_t agent = fork();
    if (agent < 0) die("fork");
    if (agent == 0) {
        char *argv[] = {"/usr/bin/python3", "-I", "-S", "/corral/agent.py", NULL};
        char *envp[] = {"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME=/workspace",
                        "LANG=C.UTF-8", NULL};
        execve(argv[0], argv, envp);
        die("exec /usr/bin/python3 (does the template have python3?)");
    }
    /* PID 1 reaps every orphan; when the agent itself ends, so does the guest. */
    for (;;) {
        int status;
        pid_t pid = wait(&status);
        if (pid == agent || (pid < 0 && errno == ECHILD)) break;
    }
    fprintf(stderr, "corral-init: the agent exited; powering off\n");
    sync();
    reboot(RB_AUTOBOOT);
    return 0;
}
