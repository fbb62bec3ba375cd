// br-launch: the local sandbox's bubblewrap command line, run without bubblewrap, as root.
//
// The local sandbox builds one bwrap command line per prompt (sandbox.py, _launch_argv). As root,
// the runner compiles this program once (launcher.py) and runs that same line with it instead: it
// accepts exactly the options that line uses, with bubblewrap's meaning, and refuses any other.
// It exists for speed, measured in benchmarks/README.md (benchmarks/template_floor.py): bubblewrap
// parses /proc/self/mountinfo at every bind and remount, and pivot_root walks every task on the
// machine; here recursive read-only is one mount_setattr() and the new root is moved over the old
// one (MS_MOVE + chroot), for the same isolation at about half the CPU.
//
//   br-launch --newroot DIR [bwrap options as below] -- COMMAND...
//
// DIR: an empty directory of the host on which the sandbox's root (a tmpfs) is built, in the
// sandbox's own mount namespace. Sources are host paths, opened through a descriptor of the host's
// root; destinations are paths in the sandbox, resolved inside it (this process is chrooted into the
// new root while it builds it, so a symlink there, relative or absolute, leads nowhere else). Options, in the order given, as bubblewrap applies them:
//   --unshare-pid --unshare-net --unshare-ipc --unshare-uts --unshare-cgroup-try
//   --die-with-parent --new-session --as-pid-1 --cap-drop ALL
//   --ro-bind SRC DEST  --ro-bind-try SRC DEST  --symlink TARGET DEST  --dir DEST
//   --dev DEST  --proc DEST  --size BYTES --tmpfs DEST  --remount-ro DEST  --chdir DIR
//   (no DEST under /dev, but --tmpfs /dev/shm)
//   --seccomp FD (a classic BPF program, struct sock_filter[], read from FD; loaded last before exec)
// Errors at set-up are printed as "br-launch: Can't <what>: <why>" (exit 1), as bubblewrap's are.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/seccomp.h>
#include <linux/securebits.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

enum kind { RO_BIND, RO_BIND_TRY, SYMLINK, DIR_, DEV, PROC, TMPFS, REMOUNT_RO };
struct op {
    enum kind kind;
    const char *src, *dest;
    long long size;
};

#define MAX_OPS 4096
static struct op ops[MAX_OPS];
static int n_ops;
static int clone_flags, die_with_parent, new_session, as_pid_1, cap_drop;
static const char *newroot, *chdir_to;
static char **command;
static struct sock_filter seccomp_prog[MAX_OPS];
static unsigned short seccomp_len;  // 0: no --seccomp
static pid_t parent_at_start;
static int alive_pipe[2];  // the launcher holds the write end while it lives
static int host_root = -1;  // the host's /, for the sources, while the new root is built

static void fail(const char *fmt, ...) {
    va_list ap;
    int saved = errno;
    fputs("br-launch: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    if (saved) fprintf(stderr, ": %s", strerror(saved));
    fputc('\n', stderr);
    _exit(1);
}

static void usage(const char *what) {
    errno = 0;
    fail("%s (this program takes only the options the local sandbox's command line uses)", what);
}

// A destination, checked: absolute, no "." or ".." component, and nothing under /dev but /dev
// itself (its entries are devices and links this program made) and a tmpfs at /dev/shm (a plain
// directory make_dev made; checked again when it is mounted).
static const char *checked(enum kind kind, const char *dest) {
    if (dest[0] != '/') usage("a destination must be an absolute path");
    for (const char *p = dest; *p;) {
        while (*p == '/') p++;
        const char *end = strchrnul(p, '/');
        if ((end - p == 1 && p[0] == '.') || (end - p == 2 && p[0] == '.' && p[1] == '.'))
            usage("a destination may not have a . or .. component");
        p = end;
    }
    if (strncmp(dest, "/dev/", 5) == 0 && !(kind == TMPFS && strcmp(dest, "/dev/shm") == 0))
        usage("a destination may not lie under /dev");
    if (strlen(dest) >= PATH_MAX - 64) usage("a destination is too long");
    return dest;
}

// A source: a host path, relative to the host's root (this process is chrooted into the new one).
static const char *host_path(const char *src) {
    if (src[0] != '/') usage("a source must be an absolute path");
    while (*src == '/') src++;
    return *src ? src : ".";
}

// A copy of the host's tree at src (with what is mounted below it when recursive), mounted at dest.
static void bind_from_host(const char *src, const char *dest, int recursive) {
    int tree = syscall(SYS_open_tree, host_root, host_path(src),
                       OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | (recursive ? AT_RECURSIVE : 0));
    if (tree < 0) fail("Can't bind mount %s on %s", src, dest);
    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, dest, MOVE_MOUNT_F_EMPTY_PATH))
        fail("Can't bind mount %s on %s", src, dest);
    close(tree);
}

static void mkdirs(const char *path, mode_t mode) {  // mkdir -p; what exists already is fine
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(tmp, 0755) && errno != EEXIST) fail("Can't mkdir %s", tmp);
        *p = '/';
    }
    if (mkdir(tmp, mode) && errno != EEXIST) fail("Can't mkdir %s", tmp);
}

static void parent_dirs(const char *path) {
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", path);
    char *slash = strrchr(tmp, '/');
    if (slash && slash != tmp) {
        *slash = 0;
        mkdirs(tmp, 0755);
    }
}

static void set_attr(const char *path, unsigned long long set, int recursive) {
    struct mount_attr attr = {.attr_set = set};
    if (syscall(SYS_mount_setattr, AT_FDCWD, path, recursive ? AT_RECURSIVE : 0, &attr, sizeof attr))
        fail("Can't remount %s", path);
}

static void bind_ro(const char *src, const char *dest, int is_try) {
    struct stat st;
    if (fstatat(host_root, host_path(src), &st, 0)) {
        if (is_try && errno == ENOENT) return;
        fail("Can't find source path %s", src);
    }
    if (S_ISDIR(st.st_mode)) {
        mkdirs(dest, 0755);
    } else {
        parent_dirs(dest);
        int fd = open(dest, O_CREAT | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0444);
        if (fd >= 0) close(fd);
        else if (errno != EEXIST && errno != EROFS && errno != ENXIO && errno != EISDIR && errno != ETXTBSY)
            fail("Can't create file at %s", dest);
    }
    bind_from_host(src, dest, 1);
    set_attr(dest, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 1);
}

static void make_dev(const char *dest) {
    static const char *nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
    static const char *links[][2] = {{"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"},
                                     {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"},
                                     {"/proc/kcore", "core"}, {"pts/ptmx", "ptmx"}};
    char path[PATH_MAX], src[64];
    mkdirs(dest, 0755);
    if (mount("tmpfs", dest, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")) fail("Can't mount tmpfs on %s", dest);
    for (unsigned i = 0; i < sizeof nodes / sizeof *nodes; i++) {
        snprintf(path, sizeof path, "%s/%s", dest, nodes[i]);
        snprintf(src, sizeof src, "/dev/%s", nodes[i]);
        int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0444);
        if (fd < 0) fail("Can't create file at %s", path);
        close(fd);
        bind_from_host(src, path, 0);
        set_attr(path, MOUNT_ATTR_NOSUID, 0);
    }
    snprintf(path, sizeof path, "%s/shm", dest);
    mkdirs(path, 0755);
    snprintf(path, sizeof path, "%s/pts", dest);
    mkdirs(path, 0755);
    if (mount("devpts", path, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620"))
        fail("Can't mount devpts on %s", path);
    for (unsigned i = 0; i < sizeof links / sizeof *links; i++) {
        snprintf(path, sizeof path, "%s/%s", dest, links[i][1]);
        if (symlink(links[i][0], path)) fail("Can't make symlink at %s", path);
    }
}

static void make_proc(const char *dest) {
    // As bubblewrap does without a user namespace: these stay read-only, whatever the caller binds.
    static const char *covered[] = {"sys", "sysrq-trigger", "irq", "bus"};
    char path[PATH_MAX];
    mkdirs(dest, 0755);
    if (mount("proc", dest, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL)) fail("Can't mount proc on %s", dest);
    for (unsigned i = 0; i < sizeof covered / sizeof *covered; i++) {
        snprintf(path, sizeof path, "%s/%s", dest, covered[i]);
        if (access(path, F_OK)) continue;
        if (mount(path, path, NULL, MS_BIND | MS_REC, NULL)) fail("Can't bind mount %s", path);
        set_attr(path, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC, 1);
    }
}

static void drop_everything(void) {
    if (new_session && setsid() < 0) fail("Can't start a new session");
    if (cap_drop) {
        // No capability now, none regained by exec as root (uid 0 stays uid 0): the bounding set
        // emptied and root's special treatment locked off, then no_new_privs as bubblewrap sets it.
        for (int c = 0; c <= CAP_LAST_CAP; c++)
            if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) && errno != EINVAL) fail("Can't drop capability %d", c);
        if (prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP |
                                         SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED, 0, 0, 0))
            fail("Can't set securebits");
        if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) && errno != EINVAL)
            fail("Can't clear ambient capabilities");
        struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
        struct __user_cap_data_struct d[2];
        memset(d, 0, sizeof d);
        if (syscall(SYS_capset, &h, d)) fail("Can't drop capabilities");
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) fail("Can't set no_new_privs");
}

static void loopback_up(void) {  // as bubblewrap: the new network namespace's lo, up (127.0.0.1, ::1)
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    if (fd < 0) fail("Can't create a socket to bring up lo");
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (ioctl(fd, SIOCGIFFLAGS, &ifr)) fail("Can't read lo's flags");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(fd, SIOCSIFFLAGS, &ifr)) fail("Can't bring up lo");
    close(fd);
}

static int sandbox(void) {
    if (die_with_parent && prctl(PR_SET_PDEATHSIG, SIGKILL)) fail("Can't set the parent-death signal");
    // The launcher is outside this PID namespace (getppid() says 0): its end of a pipe tells
    // whether it died before the signal was set.
    close(alive_pipe[1]);
    struct pollfd pfd = {.fd = alive_pipe[0], .events = POLLIN};
    if (die_with_parent && poll(&pfd, 1, 0) > 0) _exit(1);
    close(alive_pipe[0]);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (clone_flags & CLONE_NEWNET) loopback_up();
    if (mount(NULL, "/", NULL, MS_SLAVE | MS_REC, NULL)) fail("Can't make / a slave mount");
    if (mount("tmpfs", newroot, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")) fail("Can't mount the new root");
    host_root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (host_root < 0 || chdir(newroot) || chroot(".")) fail("Can't enter the new root to build it");
    for (int i = 0; i < n_ops; i++) {
        const struct op *o = &ops[i];
        const char *dest = o->dest;
        char data[64];
        switch (o->kind) {
        case RO_BIND:
        case RO_BIND_TRY:
            bind_ro(o->src, dest, o->kind == RO_BIND_TRY);
            break;
        case SYMLINK:
            parent_dirs(dest);
            if (symlink(o->src, dest) && errno != EEXIST) fail("Can't make symlink at %s", o->dest);
            break;
        case DIR_:
            mkdirs(dest, 0755);
            break;
        case DEV:
            make_dev(dest);
            break;
        case PROC:
            make_proc(dest);
            break;
        case TMPFS:
            if (!strncmp(dest, "/dev/", 5)) {  // /dev/shm: the directory make_dev made, never through a link
                struct stat st;
                if (lstat("/dev", &st) || !S_ISDIR(st.st_mode) || lstat(dest, &st) || !S_ISDIR(st.st_mode))
                    fail("Can't mount tmpfs on %s: not a directory", dest);
            }
            mkdirs(dest, 0755);
            if (o->size >= 0) snprintf(data, sizeof data, "mode=0755,size=%lld", o->size);
            else snprintf(data, sizeof data, "mode=0755");
            if (mount("tmpfs", dest, "tmpfs", MS_NOSUID | MS_NODEV, data)) fail("Can't mount tmpfs on %s", dest);
            break;
        case REMOUNT_RO:
            set_attr(dest, MOUNT_ATTR_RDONLY, 0);
            break;
        }
    }
    // The new root over the host's: nothing of the host's tree is left to reach, not even below it.
    if (fchdir(host_root) || chroot(".") || chdir(newroot)) fail("Can't return to the host's root");
    if (mount(".", "/", NULL, MS_MOVE, NULL)) fail("Can't move the new root over /");
    if (chroot(".") || chdir("/")) fail("Can't enter the new root");
    close(host_root);
    if (chdir_to && chdir(chdir_to)) fail("Can't chdir to %s", chdir_to);
    drop_everything();
    if (syscall(SYS_close_range, 3, ~0U, 0)) {
        for (int fd = 3; fd < 65536; fd++) close(fd);
    }
    if (seccomp_len) {  // last, as bubblewrap: nothing of the set-up runs under it
        struct sock_fprog fprog = {.len = seccomp_len, .filter = seccomp_prog};
        if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &fprog, 0, 0)) fail("Can't load the seccomp filter");
    }
    execvp(command[0], command);
    fail("Can't execute %s", command[0]);
    return 1;
}

static const char *need(char **argv, int *i, int argc) {
    if (*i + 1 >= argc) usage("an option is missing its argument");
    return argv[++*i];
}

static void add(enum kind kind, const char *src, const char *dest, long long size) {
    if (n_ops == MAX_OPS) usage("too many options");
    ops[n_ops++] = (struct op){kind, src, dest, size};
}

static void load_seccomp(const char *arg) {  // the whole program, read now; the descriptor closed
    char *end;
    errno = 0;
    long fd = strtol(arg, &end, 10);
    if (errno || *end || fd < 0 || fd > INT_MAX || seccomp_len) usage("--seccomp takes one descriptor");
    size_t got = 0;
    char *buf = (char *)seccomp_prog;
    for (;;) {
        ssize_t n = read((int)fd, buf + got, sizeof seccomp_prog - got);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) fail("Can't read the seccomp filter");
        if (n == 0) break;
        got += (size_t)n;
        if (got == sizeof seccomp_prog) usage("the seccomp filter is too long");
    }
    close((int)fd);
    if (got == 0 || got % sizeof seccomp_prog[0]) usage("the seccomp filter is not a whole program");
    seccomp_len = (unsigned short)(got / sizeof seccomp_prog[0]);
}

int main(int argc, char **argv) {
    long long size = -1;
    parent_at_start = getppid();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) {
            command = argv + i + 1;
            break;
        } else if (!strcmp(a, "--newroot")) newroot = need(argv, &i, argc);
        else if (!strcmp(a, "--unshare-pid")) clone_flags |= CLONE_NEWPID;
        else if (!strcmp(a, "--unshare-net")) clone_flags |= CLONE_NEWNET;
        else if (!strcmp(a, "--unshare-ipc")) clone_flags |= CLONE_NEWIPC;
        else if (!strcmp(a, "--unshare-uts")) clone_flags |= CLONE_NEWUTS;
        else if (!strcmp(a, "--unshare-cgroup-try")) clone_flags |= CLONE_NEWCGROUP;
        else if (!strcmp(a, "--die-with-parent")) die_with_parent = 1;
        else if (!strcmp(a, "--new-session")) new_session = 1;
        else if (!strcmp(a, "--as-pid-1")) as_pid_1 = 1;
        else if (!strcmp(a, "--cap-drop")) {
            if (strcmp(need(argv, &i, argc), "ALL")) usage("--cap-drop takes only ALL");
            cap_drop = 1;
        } else if (!strcmp(a, "--ro-bind") || !strcmp(a, "--ro-bind-try") || !strcmp(a, "--symlink")) {
            const char *src = need(argv, &i, argc), *dest = need(argv, &i, argc);
            add(!strcmp(a, "--symlink") ? SYMLINK : !strcmp(a, "--ro-bind") ? RO_BIND : RO_BIND_TRY, src, dest, -1);
        } else if (!strcmp(a, "--dir")) add(DIR_, NULL, need(argv, &i, argc), -1);
        else if (!strcmp(a, "--dev")) add(DEV, NULL, need(argv, &i, argc), -1);
        else if (!strcmp(a, "--proc")) add(PROC, NULL, need(argv, &i, argc), -1);
        else if (!strcmp(a, "--remount-ro")) add(REMOUNT_RO, NULL, need(argv, &i, argc), -1);
        else if (!strcmp(a, "--size")) {
            char *end;
            errno = 0;
            size = strtoll(need(argv, &i, argc), &end, 10);
            if (errno || *end || size <= 0) usage("--size takes a positive number of bytes");
        } else if (!strcmp(a, "--tmpfs")) {
            add(TMPFS, NULL, need(argv, &i, argc), size);
            size = -1;
        } else if (!strcmp(a, "--chdir")) chdir_to = need(argv, &i, argc);
        else if (!strcmp(a, "--seccomp")) load_seccomp(need(argv, &i, argc));
        else {
            errno = 0;
            fail("unknown option %s (this program takes only the options the local sandbox's command line uses)", a);
        }
    }
    if (!command || !command[0]) usage("no command after --");
    if (!newroot || newroot[0] != '/') usage("--newroot takes an absolute path");
    if (!as_pid_1 || !(clone_flags & CLONE_NEWPID)) usage("only --unshare-pid --as-pid-1 is supported");
    for (int i = 0; i < n_ops; i++) checked(ops[i].kind, ops[i].dest);  // refused before anything is made
    if (die_with_parent) {
        if (prctl(PR_SET_PDEATHSIG, SIGKILL)) fail("Can't set the parent-death signal");
        if (getppid() != parent_at_start) _exit(1);  // the parent died before the signal was set
    }
    if (pipe2(alive_pipe, O_CLOEXEC)) fail("Can't make a pipe");
    pid_t pid = syscall(SYS_clone, clone_flags | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0);
    if (pid < 0 && errno == EINVAL && (clone_flags & CLONE_NEWCGROUP)) {
        clone_flags &= ~CLONE_NEWCGROUP;  // --unshare-cgroup-try: without one where there is none
        pid = syscall(SYS_clone, clone_flags | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0);
    }
    if (pid < 0) fail("Can't create the sandbox's namespaces");
    if (pid == 0) return sandbox();
    close(alive_pipe[0]);
    // The monitor, as bubblewrap's: it lives as long as the sandbox's PID 1, and exits as it did.
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) fail("Can't wait for the sandbox");
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    return 128 + WTERMSIG(status);
}
