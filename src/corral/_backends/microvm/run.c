/* /corral/run: the guest's per-command launcher, started by the agent for every exec.
 *
 *   run CGROUP_DIR CWD TMP_BYTES INFO_FD STATUS_FD PTY(0|1) SECCOMP_FILE -- ARGV...
 *
 * SECCOMP_FILE holds the raw BPF program of the other tiers' syscall filter (compiled on the
 * host by libseccomp, sent with each exec); it is installed right before execve, after
 * no_new_privs. "-" (only the agent's host-side test mode sends it) means none.
 *
 * with exactly the command's environment (it is passed on to execvp untouched). It joins the
 * command's cgroup (so everything after is counted and killable with cgroup.kill), unshares a
 * PID and a mount namespace and forks that namespace's init, which mounts a /proc of the new
 * namespace (and a fresh tmpfs on /tmp when TMP_BYTES is "SIZE", not "-SIZE"), then forks
 * the command: setsid (and the PTY as controlling
 * terminal), uid/gid 1000 without supplementary groups, no_new_privs, no core dumps, cwd, exec.
 *
 * INFO_FD (close-on-exec) tells the agent why a command never started, as bwrap's info fd does:
 * one line "cwd ERRNO", "exec ERRNO" or "setup ERRNO WHAT"; EOF with nothing written means the
 * exec succeeded. STATUS_FD is written by the init alone, just before it exits: "exit C" or
 * "signal S" for the command, so the agent can tell a command killed by a signal from one that
 * exited with 128+S. The init reaps every process of the namespace; when it exits the kernel
 * kills whatever is left in it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#define USER_ID 1000

static int info_fd = -1;
static struct sock_fprog filter;  /* len 0: none */

static void report(const char *kind, int err, const char *what) {
    char line[512];
    int n = snprintf(line, sizeof line, "%s %d %s\n", kind, err, what ? what : "");
    if (info_fd >= 0 && n > 0) {
        ssize_t ignored = write(info_fd, line, (size_t)n);
        (void)ignored;
    }
}

static void fail(const char *what) {
    report("setup", errno, what);
    _exit(127);
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) fail(path);
    size_t len = strlen(text);
    if (write(fd, text, len) != (ssize_t)len) fail(path);
    close(fd);
}

static int exit_code(int status) {
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return 255;
}

static void command(char *cwd, int pty, char **argv) {
    /* The default dispositions: the agent's Python ignores SIGPIPE, and ignored signals survive
     * exec; a blocked mask does too. */
    for (int sig = 1; sig < NSIG; sig++) signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (setsid() < 0) fail("setsid");
    if (pty && ioctl(0, TIOCSCTTY, 0) != 0) fail("TIOCSCTTY");
    struct rlimit core = {0, 0};
    if (setrlimit(RLIMIT_CORE, &core) != 0) fail("RLIMIT_CORE");
    /* Empty bounding and ambient sets, as bwrap leaves them on the namespace tier: nothing
     * exec'd later (no_new_privs aside) can regain a capability. */
    for (int cap = 0; cap <= 63; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL) fail("CAPBSET_DROP");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0) fail("CAP_AMBIENT");
    if (setgroups(0, NULL) != 0) fail("setgroups");
    if (setgid(USER_ID) != 0) fail("setgid");
    if (setuid(USER_ID) != 0) fail("setuid");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail("PR_SET_NO_NEW_PRIVS");
    /* After dropping root, so a directory the user cannot enter is refused as it would be. */
    if (chdir(cwd) != 0) {
        report("cwd", errno, cwd);
        _exit(127);
    }
    /* Last: from here the command's own filter applies (execve and write are allowed). */
    if (filter.len && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter, 0, 0) != 0)
        fail("PR_SET_SECCOMP");
    execvp(argv[0], argv);
    report("exec", errno, argv[0]);
    _exit(127);
}

static void make_node(const char *name, unsigned int major, unsigned int minor) {
    char path[64];
    snprintf(path, sizeof path, "/dev/%s", name);
    if (mknod(path, S_IFCHR | 0666, makedev(major, minor)) != 0) fail(path);
    if (chmod(path, 0666) != 0) fail(path);  /* the umask took bits off */
}

/* A /dev of the command's own with what bwrap's --dev gives on the namespace tier: null, zero,
 * full, random, urandom, tty, a private devpts and shm. Not the guest's devtmpfs: its disks,
 * console, serial and agent ports are none of a command's business. */
static void minimal_dev(const char *shm_opts) {
    if (mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755") != 0)
        fail("mount /dev");
    make_node("null", 1, 3);
    make_node("zero", 1, 5);
    make_node("full", 1, 7);
    make_node("random", 1, 8);
    make_node("urandom", 1, 9);
    make_node("tty", 5, 0);
    if (mkdir("/dev/pts", 0755) != 0 || mkdir("/dev/shm", 01777) != 0) fail("mkdir /dev/*");
    if (mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
              "newinstance,ptmxmode=0666,mode=0620") != 0)
        fail("mount /dev/pts");
    if (symlink("pts/ptmx", "/dev/ptmx") != 0) fail("/dev/ptmx");
    if (mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, shm_opts) != 0)
        fail("mount /dev/shm");
    const char *links[][2] = {{"/proc/self/fd", "/dev/fd"}, {"/proc/self/fd/0", "/dev/stdin"},
                              {"/proc/self/fd/1", "/dev/stdout"},
                              {"/proc/self/fd/2", "/dev/stderr"}};
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++)
        if (symlink(links[i][0], links[i][1]) != 0) fail(links[i][1]);
    /* No /sys either (as on the namespace tier): an empty read-only directory. */
    if (mount("tmpfs", "/sys", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
              "size=4k,mode=0555") != 0)
        fail("mount /sys");
}

static void init(const char *cgroup, char *cwd, const char *tmp_bytes, int status_fd, int pty,
                 char **argv) {
    (void)cgroup;
    /* Nothing mounted here may reach the agent's namespace. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) fail("make / private");
    char opts[64];
    /* "-SIZE": /tmp is the guest's own, which lives as long as the VM (the sandbox); "SIZE":
     * a fresh one for this command (the agent's host-side test mode, whose /tmp is the
     * host's). SIZE is also /dev/shm's. */
    int own_tmp = tmp_bytes[0] != '-';
    snprintf(opts, sizeof opts, "size=%s,mode=1777", own_tmp ? tmp_bytes : tmp_bytes + 1);
    if (own_tmp && mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts) != 0)
        fail("mount /tmp");
    /* /dev (with /dev/shm: POSIX shared memory, semaphores) is the command's own, as on the
     * other tiers: nothing written there outlives the command. */
    minimal_dev(opts);
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        fail("mount /proc");
    pid_t child = fork();
    if (child < 0) fail("fork command");
    if (child == 0) {
        close(status_fd);
        command(cwd, pty, argv);
    }
    close(info_fd);
    info_fd = -1;
    /* The init of a PID namespace gets no signal it has no handler for, so it needs none. */
    int code = 255;
    char line[64];
    int len = snprintf(line, sizeof line, "exit 255\n");
    for (;;) {
        int status;
        pid_t pid = wait(&status);
        if (pid < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (pid == child) {
            code = exit_code(status);
            if (WIFSIGNALED(status))
                len = snprintf(line, sizeof line, "signal %d\n", WTERMSIG(status));
            else
                len = snprintf(line, sizeof line, "exit %d\n", code);
            break;
        }
    }
    ssize_t ignored = write(status_fd, line, (size_t)len);
    (void)ignored;
    _exit(code);
}

static void load_filter(const char *path) {
    if (strcmp(path, "-") == 0) return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("open the seccomp filter");
    struct stat st;
    if (fstat(fd, &st) != 0) fail("stat the seccomp filter");
    if (st.st_size <= 0 || st.st_size % sizeof(struct sock_filter) || st.st_size > 65536) {
        errno = EINVAL;
        fail("seccomp filter size");
    }
    struct sock_filter *prog = malloc((size_t)st.st_size);
    if (!prog) fail("malloc");
    if (read(fd, prog, (size_t)st.st_size) != st.st_size) fail("read the seccomp filter");
    close(fd);
    filter.len = (unsigned short)(st.st_size / sizeof(struct sock_filter));
    filter.filter = prog;
}

int main(int argc, char **argv) {
    if (argc < 10 || strcmp(argv[8], "--") != 0) {
        fprintf(stderr, "usage: run CGROUP CWD TMP_BYTES INFO_FD STATUS_FD PTY SECCOMP -- "
                        "ARGV...\n");
        return 127;
    }
    const char *cgroup = argv[1];
    char *cwd = argv[2];
    const char *tmp_bytes = argv[3];
    info_fd = atoi(argv[4]);
    int status_fd = atoi(argv[5]);
    int pty = strcmp(argv[6], "1") == 0;
    if (fcntl(info_fd, F_SETFD, FD_CLOEXEC) != 0 || fcntl(status_fd, F_SETFD, FD_CLOEXEC) != 0)
        fail("fds");
    for (const char *c = tmp_bytes + (tmp_bytes[0] == '-'); *c; c++)
        if (*c < '0' || *c > '9') { errno = EINVAL; fail("TMP_BYTES"); }
    load_filter(argv[7]);

    /* The agent runs with oom_score_adj -1000, which children inherit: the command must be
     * killable by the OOM killer (raising it needs no privilege). */
    write_file("/proc/self/oom_score_adj", "0");
    if (cgroup[0]) {
        char procs[4096];
        snprintf(procs, sizeof procs, "%s/cgroup.procs", cgroup);
        write_file(procs, "0");
    }
    if (unshare(CLONE_NEWPID | CLONE_NEWNS) != 0) fail("unshare");
    pid_t pid = fork();
    if (pid < 0) fail("fork init");
    if (pid == 0) init(cgroup, cwd, tmp_bytes, status_fd, pty, argv + 9);
    close(info_fd);
    close(status_fd);
    info_fd = -1;
    for (;;) {
        int status;
        pid_t got = waitpid(pid, &status, 0);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return 255;
        return exit_code(status);
    }
}
