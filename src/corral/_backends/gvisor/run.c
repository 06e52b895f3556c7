/* The per-command launcher inside a resident gVisor sandbox (see inside.py, resident.py).
 *
 *   run FILTER TMP_BYTES NPROC CWD -- ARGV...     (environment: the command's, exactly)
 *   run FILTER TMP_BYTES NPROC --pool             (the command comes later, on fd 4)
 *   fds: 0 1 2 the command's stdio, 3 the status pipe to the helper, 4 the request (pooled)
 *
 * Pooled: the helper keeps one launcher set up ahead (namespaces, mounts, init), so a
 * command's latency is only the request, a vfork and the exec.
 *
 * Started by the helper with posix_spawn (vfork: no copy of the helper's address space; a
 * Python fork costs 20-45 ms in gVisor's systrap, this whole launcher ~30 ms). It unshares a
 * mount and a PID namespace, mounts a fresh size-limited /dev/shm, and forks the
 * namespace's init as the helper's child and exits. init mounts /proc and becomes what the
 * command will be, but for its real and saved uid: group 1000, effective uid 1000, no
 * capabilities (bounding set emptied, every set cleared), non-dumpable, RLIMIT_NPROC/CORE,
 * no_new_privs and the namespace tier's seccomp filter; then (pooled: once the request comes)
 * it vforks the command, which takes uid 1000 whole and its cwd and execs, and reaps until the
 * command exits. init's exit makes gVisor's kernel kill whatever is left in the namespace, so
 * the command's tree is gone when the helper has reaped init.
 *
 * Why init keeps real and saved uid 0: gVisor does not shield a PID namespace's init from
 * signals sent inside it, as Linux does (a signal without a handler is dropped there), and
 * lets a process signal any other whose real or saved uid is its own. An init of uid 1000
 * could be stopped by its command (`kill -STOP 1`: nobody reaps, the command hangs until its
 * timeout) or killed (its answer lost). With real and saved uid 0, and no capability to use
 * them, the command's kill(1, ...) fails with EPERM, however often it tries, as on the microVM
 * tier, whose init is root.
 *
 * Status lines on fd 3: "init PID" (the helper kills it to kill the command), then one of
 * "exit CODE CPU_US MAXRSS_KB", "error ERRNO WHAT" (set-up failed: nothing ran) or "exec ERRNO
 * PROGRAM" (execve failed: the program cannot be run, the caller words it as a shell would).
 * Static, libc only. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <grp.h>
#include <linux/capability.h>

#define STATUS_FD 3
#define REQUEST_FD 4
#define SANDBOX_ID 1000
#define MAX_FILTER (4096 * sizeof(struct sock_filter))

static void report_error(const char *what) {
    dprintf(STATUS_FD, "error %d %s\n", errno, what);
}

static void fail(const char *what) {
    report_error(what);
    _exit(125);
}

/* Empty every capability set. Leaving uid 0 for good (setresuid to all non-zero) would do it;
 * init keeps real and saved uid 0, so the permitted set must be emptied explicitly. */
static int drop_capabilities(void) {
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];
    memset(data, 0, sizeof data);
    return (int)syscall(SYS_capset, &header, data);
}

static int code_of(int status) {
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* The pooled mode's request on REQUEST_FD, read to EOF: "CWD\0ARGC\0ARGV...\0ENVC\0ENV...\0"
 * (counts in decimal). Fills cwd, command and env from one buffer that lives until exec. */
static int read_request(char **cwd, char ***command, char ***env) {
    size_t size = 0, cap = 1 << 16;
    char *buf = malloc(cap);
    if (buf == NULL) return -1;
    for (;;) {
        if (size == cap && (buf = realloc(buf, cap *= 2)) == NULL) return -1;
        ssize_t got = read(REQUEST_FD, buf + size, cap - size);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return -1;
        if (got == 0) break;
        size += (size_t)got;
    }
    close(REQUEST_FD);
    size_t at = 0;
    char *fields[3];
    size_t nfields = 0, counts[2] = {0, 0};
    char **lists[2] = {NULL, NULL};
    /* cwd, then two counted lists */
    for (int part = 0; part < 5; part++) {
        if (at >= size || memchr(buf + at, 0, size - at) == NULL) { errno = EINVAL; return -1; }
        char *field = buf + at;
        at += strlen(field) + 1;
        if (part == 0) { fields[nfields++] = field; continue; }
        if (part == 1 || part == 3) {
            size_t list = part == 1 ? 0 : 1;
            counts[list] = strtoul(field, NULL, 10);
            if (counts[list] > size) { errno = EINVAL; return -1; }
            lists[list] = calloc(counts[list] + 1, sizeof(char *));
            if (lists[list] == NULL) return -1;
            for (size_t i = 0; i < counts[list]; i++) {
                if (at >= size || memchr(buf + at, 0, size - at) == NULL) {
                    errno = EINVAL;
                    return -1;
                }
                lists[list][i] = buf + at;
                at += strlen(buf + at) + 1;
            }
            part++;
        }
    }
    if (counts[0] == 0) { errno = EINVAL; return -1; }
    *cwd = fields[0];
    *command = lists[0];
    *env = lists[1];
    return 0;
}

int main(int argc, char **argv) {
    int pooled = argc == 5 && strcmp(argv[4], "--pool") == 0;
    if (!pooled && (argc < 7 || strcmp(argv[5], "--") != 0)) {
        dprintf(STATUS_FD, "error %d usage\n", EINVAL);
        return 125;
    }
    extern char **environ;
    char *cwd = pooled ? NULL : argv[4];
    char **command = pooled ? NULL : argv + 6;
    char **env = environ;
    unsigned long long tmp_bytes = strtoull(argv[2], NULL, 10);
    rlim_t nproc = (rlim_t)strtoull(argv[3], NULL, 10);

    /* The filter first: a launcher that cannot read it never starts anything. */
    static char program[MAX_FILTER];
    int ffd = open(argv[1], O_RDONLY | O_CLOEXEC);
    if (ffd < 0) fail("open filter");
    ssize_t got = read(ffd, program, sizeof program);
    close(ffd);
    if (got <= 0 || got % sizeof(struct sock_filter)) { errno = EINVAL; fail("filter"); }
    struct sock_fprog fprog = {
        .len = (unsigned short)(got / sizeof(struct sock_filter)),
        .filter = (struct sock_filter *)program,
    };

    if (unshare(CLONE_NEWNS | CLONE_NEWPID)) fail("unshare");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) fail("mount private");
    char options[64];
    snprintf(options, sizeof options, "size=%llu,mode=1777", tmp_bytes);
    /* No /tmp of its own: the sandbox's (a bind of its host tmpfs) outlives the command. */
    if (mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, options)) fail("mount /dev/shm");

    /* init is made the helper's child (CLONE_PARENT), not ours: we exit at once and the
     * helper reaps init itself, so no exit of ours lies between the command's end and its
     * answer. Like fork(): a raw clone without a new stack continues on a copy of ours. */
    pid_t init = (pid_t)syscall(SYS_clone, CLONE_PARENT | SIGCHLD, 0, NULL, NULL, 0);
    if (init < 0) fail("clone init");
    if (init == 0) {
        if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL))
            fail("mount /proc");
        /* init becomes what the command will be before the command exists (pooled: while
         * nothing runs), so a command pays for none of it: a new process is all that is left.
         * It stays non-dumpable, so the command can neither trace nor read it, and its real
         * uid is not the command's, so the command cannot signal it. */
        for (int cap = 0; cap <= 63; cap++)
            if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) && errno != EINVAL) fail("capbset");
        gid_t none[1];
        if (setgroups(0, none)) fail("setgroups");
        if (setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)) fail("setresgid");
        /* Real and saved uid 0 keep the command's signals off init (see the top). */
        if (setresuid(0, SANDBOX_ID, 0)) fail("setresuid");
        if (drop_capabilities()) fail("capset");
        if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) fail("dumpable");
        /* gVisor charges a process, for its whole life, to the real uid of the process that
         * made it: the command's first process to init's (0), the rest of its tree to 1000.
         * One fewer for the rest keeps the tree within NPROC processes. */
        rlim_t tree = nproc > 1 ? nproc - 1 : nproc;
        struct rlimit procs = {tree, tree}, core = {0, 0};
        if (nproc && setrlimit(RLIMIT_NPROC, &procs)) fail("rlimit nproc");
        if (setrlimit(RLIMIT_CORE, &core)) fail("rlimit core");
        if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) fail("no_new_privs");
        if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0)) fail("seccomp");
        /* Pooled: everything above was done ahead of time; the command comes now. */
        if (pooled && read_request(&cwd, &command, &env)) fail("request");
        pid_t child = vfork();
        if (child < 0) fail("vfork");
        if (child == 0) {
            /* Only async-signal-safe calls here (vfork shares init's memory until execve). */
            setsid();
            /* Allowed without a capability: 1000 is init's effective uid. A raw system call:
             * libc's setresuid may signal the threads of a process, and this one shares init's. */
            if (syscall(SYS_setresuid, SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)) fail("setresuid");
            if (chdir(cwd)) fail("chdir");
            /* Closed by a successful execve only: a failed one is reported on it. */
            if (fcntl(STATUS_FD, F_SETFD, FD_CLOEXEC)) fail("cloexec");
            execvpe(command[0], command, env);
            dprintf(STATUS_FD, "exec %d %s\n", errno, command[0]);
            _exit(errno == ENOENT ? 127 : 126);
        }
        close(0);
        close(1);
        close(2);
        int status = 0, code = 0;
        struct rusage usage;
        long long cpu_us = 0;
        long maxrss = 0;
        pid_t pid;
        while ((pid = wait4(-1, &status, 0, &usage)) > 0) {
            cpu_us += (long long)usage.ru_utime.tv_sec * 1000000 + usage.ru_utime.tv_usec
                    + (long long)usage.ru_stime.tv_sec * 1000000 + usage.ru_stime.tv_usec;
            if (usage.ru_maxrss > maxrss) maxrss = usage.ru_maxrss;
            if (pid == child) { code = code_of(status); break; }
        }
        dprintf(STATUS_FD, "exit %d %lld %ld\n", code, cpu_us, maxrss);
        _exit(0); /* and the kernel kills what is left in the namespace */
    }
    dprintf(STATUS_FD, "init %d\n", (int)init);
    return 0;
}
