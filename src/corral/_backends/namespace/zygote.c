/* The resident helper of an active namespace sandbox (see resident.py).
 *
 *   zygote CONTROL_FD TMP_BYTES FILTER [MASKED_PROC...]
 *
 * It runs as the command in the sandbox's bwrap (user, PID, mount, IPC, UTS namespaces, the
 * sandbox's root, workspace and network namespace), as the sandbox's uid with CAP_SYS_ADMIN
 * and CAP_SETPCAP inside that user namespace only, and no seccomp filter: it needs unshare and
 * mount. It never runs anything of the user's itself. For each "w" on the control socket it
 * makes a command's *init*: a child in new PID, mount, IPC and UTS namespaces that sets up what
 * bwrap sets up per command (a private mount tree, a fresh size-limited /dev/shm (/tmp is the
 * sandbox's own, inherited), its
 * own devpts, a fresh /proc with bwrap's covers and the template's masks) and answers "r" on a
 * socket of its own, whose host end the zygote hands to the host on the control socket. The
 * host reads the init's host pid from that answer's credentials. The "w" carries descriptors
 * of the group the host made for the init (each v1 hierarchy's "tasks" file, opened by the
 * host): the init writes itself into it first thing, and runs nothing until the request.
 *
 * Before its "r" the init also unshares a cgroup namespace (its group becomes its root), empties
 * every capability set and the bounding set, sets no_new_privs and installs the namespace
 * tier's seccomp filter (the same program bwrap installs): it waits as the command will run.
 * A request is "x" followed by "CWD\0ARGC\0ARGV...\0ENVC\0ENV...\0" (counts in decimal) in
 * the same message, with three descriptors: stdin, stdout and stderr; a request too large for
 * one message is "m" with a fourth, a sealed memfd holding that text. The init then enters CWD
 * and vforks the command (its own address space is not copied: it waits, suspended, until the
 * child has exec'd), which starts a session of its own, takes its stdio and the request's
 * environment, and execs. The init reaps until the command
 * exits, kills and reaps whatever is left in its PID namespace, answers "x STATUS" (the exit
 * code, or minus the signal), and exits: nothing the command started outlives the answer.
 * Failures answer "e ERRNO WHAT" (set-up: nothing of the user's ran) or "n ERRNO" (execve
 * failed: the program cannot be run).
 *
 * Static, libc only. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_FILTER (4096 * sizeof(struct sock_filter))
#define MAX_REQUEST (4 << 20)
/* The most an inline request holds (the host sends a larger one in a memfd): within a
 * SEQPACKET message's default limit (the socket's send buffer). */
#define MAX_INLINE (32 << 10)

static int control_fd;
static const char *tmp_options;
static struct sock_fprog filter;
static char **masked;
static int nmasked;

extern char **environ;

static void answer(int fd, const char *text) {
    /* SEQPACKET: one message per answer; the host reads it whole. */
    while (send(fd, text, strlen(text), MSG_NOSIGNAL) < 0 && errno == EINTR) {}
}

static void init_fail(int fd, const char *what) {
    char line[128];
    snprintf(line, sizeof line, "e %d %s", errno, what);
    answer(fd, line);
    _exit(125);
}

static int read_filter(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    char *buf = malloc(MAX_FILTER);
    if (buf == NULL) return -1;
    size_t size = 0;
    for (;;) {
        ssize_t got = read(fd, buf + size, MAX_FILTER - size);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return -1;
        if (got == 0) break;
        size += (size_t)got;
        if (size == MAX_FILTER) { errno = EFBIG; return -1; }
    }
    close(fd);
    if (size == 0 || size % sizeof(struct sock_filter)) { errno = EINVAL; return -1; }
    filter.len = (unsigned short)(size / sizeof(struct sock_filter));
    filter.filter = (struct sock_filter *)buf;
    return 0;
}

/* bind PATH read-only onto TARGET (TARGET itself when PATH is NULL); a missing target is
 * skipped: the kernel has no such file to hide. */
static int bind_readonly(const char *source, const char *target) {
    if (mount(source, target, NULL, MS_BIND | MS_REC, NULL) < 0)
        return errno == ENOENT ? 0 : -1;
    return mount(NULL, target, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
                 | MS_NOEXEC, NULL);
}

static void set_up_mounts(int fd) {
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) init_fail(fd, "mount-private");
    /* No /tmp of its own: the sandbox's (bound by the resident's bwrap) lives as long as
     * the sandbox, so a file one command leaves there is the next one's. */
    if (mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, tmp_options) < 0)
        init_fail(fd, "mount-shm");
    if (mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
              "newinstance,ptmxmode=0666,mode=620") < 0)
        init_fail(fd, "mount-devpts");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        init_fail(fd, "mount-proc");
    /* What bwrap's --proc covers read-only. */
    static const char *covered[] = {"/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"};
    for (size_t i = 0; i < sizeof covered / sizeof covered[0]; i++)
        if (bind_readonly(covered[i], covered[i]) < 0) init_fail(fd, "cover-proc");
    for (int i = 0; i < nmasked; i++)
        if (bind_readonly("/dev/null", masked[i]) < 0) init_fail(fd, "mask-proc");
}

/* The request's memfd, read whole into a buffer kept until exec. */
static char *read_request(int req, size_t *size_out) {
    struct stat st;
    if (fstat(req, &st) < 0) return NULL;
    if (st.st_size <= 0 || st.st_size > MAX_REQUEST) { errno = E2BIG; return NULL; }
    size_t size = (size_t)st.st_size;
    char *buf = malloc(size);  /* its fields end in NUL themselves (parse_request checks) */
    if (buf == NULL) return NULL;
    size_t have = 0;
    while (have < size) {
        ssize_t got = pread(req, buf + have, size - have, (off_t)have);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) { errno = EIO; return NULL; }
        have += (size_t)got;
    }
    *size_out = size;
    return buf;
}

/* Fills cwd, argv and env from the request's text, which must outlive them (until exec). */
static int parse_request(char *buf, size_t size, char **cwd, char ***argv, char ***env) {
    if (size == 0 || buf[size - 1] != '\0') { errno = EINVAL; return -1; }
    char *at = buf, *end = buf + size;
#define NEXT() ({ char *field = at; if (at >= end) { errno = EINVAL; return -1; } \
                  at += strlen(at) + 1; field; })
    *cwd = NEXT();
    for (int list = 0; list < 2; list++) {
        char *count_text = NEXT();
        char *tail;
        unsigned long count = strtoul(count_text, &tail, 10);
        if (*tail != '\0' || count > size) { errno = EINVAL; return -1; }
        char **items = calloc(count + 1, sizeof(char *));
        if (items == NULL) return -1;
        for (unsigned long i = 0; i < count; i++) items[i] = NEXT();
        if (list == 0) *argv = items; else *env = items;
    }
#undef NEXT
    if ((*argv)[0] == NULL) { errno = EINVAL; return -1; }
    return 0;
}

static void drop_privileges(int fd) {
    for (int cap = 0; cap <= 63; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL)
            init_fail(fd, "capbset");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        init_fail(fd, "ambient");
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) < 0) init_fail(fd, "capset");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) init_fail(fd, "no-new-privs");
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter) < 0) init_fail(fd, "seccomp");
}

/* The request: its stdio in fds[0..2] and its text in *text (*size bytes, NUL-terminated
 * fields), from the message itself or from the memfd that came with it. */
static int receive_request(int fd, int fds[3], char **text, size_t *size) {
    static char inline_text[1 + MAX_INLINE];
    char control[CMSG_SPACE(4 * sizeof(int))];
    struct iovec iov = {inline_text, sizeof inline_text};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t got;
    while ((got = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC)) < 0 && errno == EINTR) {}
    if (got <= 0) return -1;  /* the host let this init go: nothing ran */
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    int wanted = inline_text[0] == 'm' ? 4 : 3;
    if ((inline_text[0] != 'x' && inline_text[0] != 'm') || (msg.msg_flags & MSG_TRUNC)
        || cmsg == NULL || cmsg->cmsg_type != SCM_RIGHTS
        || cmsg->cmsg_len != CMSG_LEN(wanted * sizeof(int))) {
        errno = EPROTO;
        return -2;
    }
    memcpy(fds, CMSG_DATA(cmsg), 3 * sizeof(int));
    if (wanted == 3) {
        *text = inline_text + 1;
        *size = (size_t)got - 1;
        return 0;
    }
    int memfd;
    memcpy(&memfd, CMSG_DATA(cmsg) + 3 * sizeof(int), sizeof(int));
    if (got != 1) { close(memfd); errno = EPROTO; return -2; }
    *text = read_request(memfd, size);
    close(memfd);
    return *text == NULL ? -2 : 0;
}

#define MAX_JOIN 8

static void run_init(int fd, const int *join, int njoin) {
    /* First, the init moves itself into the group the host made for it: a process moving
     * itself takes none of the kernel's global cgroup locks (see launch.c). */
    for (int i = 0; i < njoin; i++) {
        ssize_t wrote;
        while ((wrote = write(join[i], "0", 1)) < 0 && errno == EINTR) {}
        if (wrote != 1) init_fail(fd, "cgroup");
        close(join[i]);
    }
    /* The zygote ignores SIGCHLD (its inits are reaped by the kernel); an init must not. */
    signal(SIGCHLD, SIG_DFL);
    prctl(PR_SET_NAME, "init", 0, 0, 0);  /* what the command's ps shows as PID 1 */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) init_fail(fd, "pdeathsig");
    set_up_mounts(fd);
    struct rlimit nofile = {4096, 4096}, core = {0, 0};
    if (setrlimit(RLIMIT_NOFILE, &nofile) < 0 || setrlimit(RLIMIT_CORE, &core) < 0)
        init_fail(fd, "rlimit");
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);  /* the command cannot ptrace or read its init */
    /* Its group is placed: it becomes the cgroup namespace's root. The host renames the group
     * to the command's before the request, which changes its name only, not the group. */
    if (unshare(CLONE_NEWCGROUP) < 0) init_fail(fd, "unshare-cgroup");
    /* All that is left is the request's own work, which needs no privilege: the init waits
     * for it already as the command will run, without capabilities and under the filter. */
    drop_privileges(fd);
    answer(fd, "r");

    int fds[3];
    char *text = NULL;
    size_t size = 0;
    int got = receive_request(fd, fds, &text, &size);
    if (got == -1) _exit(0);
    if (got < 0) init_fail(fd, "request");
    char *cwd = NULL, **argv = NULL, **env = NULL;
    if (parse_request(text, size, &cwd, &argv, &env) < 0) init_fail(fd, "request");
    if (chdir(cwd) < 0) init_fail(fd, "chdir");

    /* vfork: the init's pages are not copied for a child that only sets up and execs; the
     * init is suspended until then, and reads the exec's failure from the memory they share.
     * The child changes only what is its own (mask, session, descriptors, signal
     * dispositions) and the environ pointer, which the init never reads again. */
    static volatile int exec_errno;
    exec_errno = 0;
    pid_t child = vfork();
    if (child < 0) init_fail(fd, "fork");
    if (child == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        setsid();
        for (int i = 0; i < 3; i++)
            if (dup2(fds[i], i) < 0) _exit(125);
        signal(SIGPIPE, SIG_DFL);
        environ = env;  /* execvp searches the command's own PATH */
        execvp(argv[0], argv);
        exec_errno = errno ? errno : ENOEXEC;
        _exit(127);
    }
    /* The command's stdout and stderr stay open here until after the answer: the host sees
     * their end and the answer at once, one wake-up where the end of the output and then the
     * answer were two. */
    close(fds[0]);
    int status = 0;
    for (;;) {
        int any;
        pid_t done = wait(&any);
        if (done == child) { status = any; break; }
        if (done < 0 && errno != EINTR) init_fail(fd, "wait");
    }
    /* The command is done: what it left (background jobs, a fork bomb) is killed and reaped
     * here, before the answer, so once the host has it nothing of the command's is left
     * (only this init, exiting). Every process of the namespace is a descendant of this init,
     * orphans included, so ECHILD means it is empty; a kill lost to a concurrent fork is
     * caught by the next round. */
    for (;;) {
        kill(-1, SIGKILL);
        pid_t done = wait(NULL);
        if (done < 0 && errno == ECHILD) break;
        if (done < 0 && errno != EINTR) init_fail(fd, "wait");
    }
    char line[64];
    if (exec_errno != 0)
        snprintf(line, sizeof line, "n %d", exec_errno);
    else
        snprintf(line, sizeof line, "x %d",
                 WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status));
    answer(fd, line);
    close(fds[1]);  /* now, not at exit: an init's exit tears its namespaces down first */
    close(fds[2]);
    _exit(0);
}

static void send_fd(int fd, const char *text) {
    char control[CMSG_SPACE(sizeof(int))];
    memset(control, 0, sizeof control);
    struct iovec iov = {(void *)text, strlen(text)};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd >= 0) {
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
    }
    while (sendmsg(control_fd, &msg, MSG_NOSIGNAL) < 0 && errno == EINTR) {}
}

static void warm(const int *join, int njoin) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) < 0) {
        char line[64];
        snprintf(line, sizeof line, "e %d socketpair", errno);
        send_fd(-1, line);
        return;
    }
    int on = 1;
    /* Set here, before the init can answer: the host reads the init's pid, in the host's PID
     * namespace, from the answer's credentials. */
    setsockopt(pair[0], SOL_SOCKET, SO_PASSCRED, &on, sizeof on);
    long pid = syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
                       | SIGCHLD, NULL, NULL, NULL, NULL);
    if (pid == 0) {
        close(control_fd);
        close(pair[0]);
        run_init(pair[1], join, njoin);
    }
    if (pid < 0) {
        char line[64];
        snprintf(line, sizeof line, "e %d clone", errno);
        send_fd(-1, line);
    } else {
        send_fd(pair[0], "i");
    }
    close(pair[0]);
    close(pair[1]);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: zygote CONTROL_FD TMP_BYTES FILTER [MASKED_PROC...]\n");
        return 2;
    }
    control_fd = atoi(argv[1]);
    static char options[64];
    snprintf(options, sizeof options, "size=%s,mode=1777", argv[2]);
    tmp_options = options;
    masked = argv + 4;
    nmasked = argc - 4;
    if (read_filter(argv[3]) < 0) {
        fprintf(stderr, "zygote: cannot read the seccomp filter %s: %s\n", argv[3],
                strerror(errno));
        return 2;
    }
    fcntl(control_fd, F_SETFD, FD_CLOEXEC);
    signal(SIGCHLD, SIG_IGN);  /* inits are reaped by the kernel; the host follows them */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    for (;;) {
        /* "w", with the descriptors of the files the init writes itself into its group with
         * (opened by the host; the zygote never writes them). */
        char byte;
        char control[CMSG_SPACE(MAX_JOIN * sizeof(int))];
        struct iovec iov = {&byte, 1};
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof control;
        ssize_t got = recvmsg(control_fd, &msg, MSG_CMSG_CLOEXEC);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return 0;  /* the host closed the control socket: stop */
        int join[MAX_JOIN];
        int njoin = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < n; i++) {
                int one;
                memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                if (njoin < MAX_JOIN) join[njoin++] = one;
                else close(one);
            }
        }
        if (byte == 'w' && !(msg.msg_flags & MSG_CTRUNC)) warm(join, njoin);
        else if (byte == 'w') send_fd(-1, "e 7 join");  /* E2BIG: more than MAX_JOIN */
        for (int i = 0; i < njoin; i++) close(join[i]);
    }
}
